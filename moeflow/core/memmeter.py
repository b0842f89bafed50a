"""How much memory a piece of work held: the peak above what the process held before.

    meter = PeakMemory().start()     # e.g. just before the first tensor is read
    ...                              # the work
    meter.peak()                     # bytes above the start

On CPU the measure is the kernel's own resident-set high-water mark (Linux
`VmHWM`, reset at `start` through /proc/self/clear_refs) minus the resident
set at `start`: exact, no sampling. `start` first hands the heap's free memory
back to the kernel (glibc `malloc_trim`): a reused process (a Ray worker) would
otherwise serve the work from memory it kept after earlier work, and the growth
would look smaller than what the work holds. On a GPU it is torch's peak allocation on
the device above the allocation at `start`. Where neither is available (not
Linux, a kernel that refuses the reset) `peak()` is None: nothing pretends.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kb(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class PeakMemory:
    """Peak memory of this process above its level at `start` (see the module docstring).

    Args:
        device: "cuda" measures torch's device allocations; anything else the resident set.
    """

    def __init__(self, device: str = "cpu"):
        self.cuda = str(device).startswith("cuda")
        self.base: int | None = None
        self.how = ""

    def start(self) -> "PeakMemory":
        if self.cuda:
            # lazy: torch: heavy, loaded only when this runs
            import torch

            torch.cuda.reset_peak_memory_stats()
            self.base, self.how = torch.cuda.memory_allocated(), "torch peak allocation on the GPU"
            return self
        _trim_heap()
        rss = _status_kb("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            return self
        self.base = None if rss is None else rss * 1024
        self.how = "peak resident set (VmHWM) minus the resident set at the start"
        return self

    def peak(self) -> int | None:
        """Bytes above the start at the highest point since; None where unmeasurable."""
        if self.base is None:
            return None
        if self.cuda:
            # lazy: torch: heavy, loaded only when this runs
            import torch

            return torch.cuda.max_memory_allocated() - self.base
        hwm = _status_kb("VmHWM")
        return None if hwm is None else max(0, hwm * 1024 - self.base)

    def record(self) -> dict:
        return {"peak_bytes": self.peak(), "measure": self.how}
