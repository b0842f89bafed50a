"""What is left of a local Ray session after the process that started it died without cleaning
up (SIGKILL, the OOM killer): found by the files its processes hold open, and stopped.

Ray fate-shares its GCS and raylet with the driver that started them (the kernel's parent-death
signal) and the workers follow the raylet; but Ray's dashboard and runtime-env agents, which
watch the raylet, log that it died and that they are exiting, and then never exit (Ray 2.60,
seen after `kill -9` of `moeflow serve`). Nothing of the driver runs after a SIGKILL, so the
driver starts this watcher beside the session (`watch_session`): a stdlib-only process in its
own session, whose stdin is a pipe only the driver holds. After its own clean stop the driver
writes one byte and closes the pipe (`release`): the watcher exits, touching nothing. End of
file with no byte means the driver is gone without cleaning up, however it went; the watcher
then gives the session `grace_s` to end by itself, SIGKILLs what still holds a file under the
session dir (never the driver's pid), stops the HAProxy processes named in the pid file of the
ingress environment it inherited, and removes the HAProxy dir the driver created.

    python -m workflows.reaper SESSION_DIR --driver PID [--remove DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

from moeflow.serving.ingress import stop_haproxy


def session_pids(session: str) -> list[int]:
    """This user's processes (not this one) holding a file under Ray's session dir: its
    workers keep their log files open there (their command lines are rewritten by Ray)."""
    own, uid, found = os.getpid(), os.getuid(), []
    session = os.path.realpath(session)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(session + "/"):
                    found.append(int(entry))
                    break
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def reap_session(session: str, grace_s: float = 5.0, spare: int | None = None) -> list[int]:
    """Wait up to grace_s for the session's processes (but `spare`) to exit, then SIGKILL the rest."""

    deadline = time.monotonic() + grace_s
    while (left := [p for p in session_pids(session) if p != spare]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


def watch_session(session: str, remove: str | None = None) -> int | None:
    """Start the watcher for `session` (and the directory `remove`, the ingress's own). Returns
    the pipe's write end, for `release` after a clean stop. Linux only (/proc). Call it with the
    ingress environment set."""

    if not sys.platform.startswith("linux"):
        return None
    read_end, write_end = os.pipe()  # both close-on-exec: no program we start holds the write end
    cmd = [sys.executable, "-m", "workflows.reaper", session, "--driver", str(os.getpid())]
    cmd += ["--remove", remove] if remove else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        subprocess.Popen(cmd, stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env=env)  # a killpg of the driver's group spares it
    except OSError:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return write_end


def release(write_end: int) -> None:
    """The driver stopped its session itself: the watcher exits and touches nothing."""
    try:
        os.write(write_end, b".")
    except OSError:  # the watcher is gone already
        pass
    finally:
        os.close(write_end)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workflows.reaper")
    ap.add_argument("session")
    ap.add_argument("--driver", type=int, required=True, help="the pid that started the session")
    ap.add_argument("--remove", default=None, help="a directory to remove once the session is gone")
    ap.add_argument("--grace-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the driver's to handle
    try:
        released = bool(os.read(0, 1))  # blocks until the driver releases it or is gone
    except OSError:
        released = False
    if released:
        return 0
    reap_session(args.session, args.grace_s, spare=args.driver)
    stop_haproxy()  # the ingress environment the driver had when it started this watcher
    if args.remove:
        shutil.rmtree(args.remove, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
