"""How `make test` and CI run pytest: `python -X faulthandler tests/run.py [pytest args]`.

pytest runs whole (its hooks, its clean-ups, its summary), then the Python-level exit handlers
run (Ray's shutdown, multiprocessing's reaping of children, logging's flush), and the process
ends with pytest's exit status without tearing the interpreter down. Why: by then this one
process has loaded Ray's core worker, torch, gloo, gRPC and aiohttp, and started and stopped
many Rays and engines; their native threads were still running while C++ static destructors ran
and once crashed CI's run with a segmentation fault (exit 139) after every test had passed.
No test and no product code runs in that teardown, so skipping it loses nothing a test checks.
`-X faulthandler` keeps Python's fault handler on past pytest's own, so a crash anywhere
(an exit handler included) still prints every thread's stack.
"""

from __future__ import annotations

import atexit
import os
import sys

import pytest

if __name__ == "__main__":
    status = int(pytest.main(sys.argv[1:]))
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # what a normal exit would run first (CPython; no public spelling)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
