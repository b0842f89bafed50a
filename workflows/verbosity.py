"""Quiet terminal by default: moeflow's own lines, not its libraries' chatter.

At the default verbosity the driver hides what users cannot act on: Ray's
worker and actor output (Ray Train's checkpoint/report lines, the placement
group cleaner's State API retries, PEFT's banner), Ray's token-auth notice,
MLflow's database-migration INFO lines, transformers' progress bars and
advisory messages, and FutureWarning/DeprecationWarning from libraries.
Stages reach the terminal through `ctx.note()` and their result records;
failures are still reported in full (child run `error.txt`, the stage table).
`moeflow -v ...` (or MOEFLOW_VERBOSE=1) shows everything.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

VERBOSE_ENV = "MOEFLOW_VERBOSE"
FLAGS = ("-v", "--verbose")

# set before transformers / huggingface_hub are imported (they read them once); Ray
# workers inherit the driver's environment, so their progress bars go too
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "MLFLOW_LOGGING_LEVEL": "WARNING",
             "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}  # "Downloading artifacts" bars


def verbose() -> bool:
    """True when the user asked for everything (-v / MOEFLOW_VERBOSE=1)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def take_flag(argv: list[str]) -> list[str]:
    """Remove -v/--verbose from a command line (any position) and remember it.

    Returns:
        argv without the flag.
    """
    rest = [a for a in argv if a not in FLAGS]
    if len(rest) != len(argv):
        os.environ[VERBOSE_ENV] = "1"
    return rest


def configure() -> None:
    """Apply the verbosity to this process (and, through the environment, to Ray workers)."""
    if verbose():
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    # library UserWarnings (e.g. pydantic/torch internals) are not the user's to fix;
    # moeflow's own warnings (module moeflow.*, tasks.*, workflows.*) still show
    for lib in ("torch", "transformers", "peft", "ray", "mlflow", "pydantic", "sqlalchemy",
                "huggingface_hub", "accelerate", "pandas"):
        warnings.filterwarnings("ignore", module=rf"{lib}(\..*)?$")
    for name in ("mlflow", "alembic", "ray", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING if name != "ray" else logging.ERROR)
    # Ray Serve's driver-side logger ("Started Serve", "Application ... is ready") gets its
    # own level, handler and no propagation whenever Serve starts, so a level set here would
    # be undone; a filter on the logger itself survives that
    serve = logging.getLogger("ray.serve")
    if not any(isinstance(f, _WarningsUp) for f in serve.filters):
        serve.addFilter(_WarningsUp())
    if "transformers" in sys.modules:
        # lazy: transformers: heavy, loaded only when this runs
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


class _WarningsUp(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def ray_init_kwargs() -> dict:
    """ray.init arguments for this verbosity: worker output and Ray's own log level."""
    if verbose():
        return {"log_to_driver": True, "logging_level": logging.WARNING}
    return {"log_to_driver": False, "logging_level": logging.ERROR}


def quiet_ray_errors() -> None:
    """Quiet mode: Ray's error-message channel to the driver (lines printed as
    `(raylet) ...`, e.g. a retried task of an actor that Serve's shutdown killed)
    goes to the `ray` logger at debug level instead of the terminal. moeflow reports what fails
    in its own stage lines; `-v` leaves Ray's printing untouched.

    Ray prints these from a listener thread through the module-level function
    `ray._private.worker.print_to_stdstream` (no public switch exists besides
    log_to_driver, which does not cover them), so that function is wrapped.
    """
    if verbose():
        return
    # lazy: ray: heavy, loaded only when this runs
    import ray._private.worker as rw

    original = rw.print_to_stdstream
    if getattr(original, "_moeflow_quiet", False):
        return

    def routed(data, ignore_prefix=False):
        if data.get("pid") == "raylet":
            for line in data.get("lines", []):
                logging.getLogger("ray").debug("(raylet) %s", line)
            return
        original(data, ignore_prefix=ignore_prefix)

    routed._moeflow_quiet = True  # type: ignore[attr-defined]  # a marker on the function
    rw.print_to_stdstream = routed
