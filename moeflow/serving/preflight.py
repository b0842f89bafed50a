"""What `moeflow serve` / `moeflow deploy` would serve, checked in the CLI process before Ray starts.

A replica that cannot start costs Ray Serve three attempts (40-60 s on a busy host) and
leaves its cause in the Serve controller's log. The checks `inspect` and `convert` make
-- config.json values, index, shard and adapter headers, no tensor data -- take seconds
here and name the file in one line. What a replica still fails on after them (an adapter
that does not fit the base, a model that does not build) comes back as its own last
exception line (`replica_failure`).

    check_deployment(dep, trust_remote_code=cfg.model.trust_remote_code)
"""

from __future__ import annotations

import re
from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.core.storage.preflight import check_readable
from moeflow.core.storage.uri import is_uri
from moeflow.serving.adapters import check_name, read_adapter_dir
from moeflow.serving.deployment import Deployment

# `module.ExceptionName: message` at the start of a line of a formatted traceback
_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): (.+)$")


def check_deployment(dep: Deployment, trust_remote_code: bool = False) -> None:
    """Raise UserError (one line naming the file) unless the base and every adapter read.

    A store URI is checked for existence only (its files are fetched by the replica);
    `models:/` adapters are the registry's (their verdict is checked before this).
    """
    for name, source in dep.adapters.items():  # first: no transformers import
        check_adapter(name, source)
    check_base(dep.checkpoint, trust_remote_code)
    local = [s for s in dep.adapters.values() if not s.startswith("models:/") and not is_uri(s)]
    if local and not is_uri(dep.checkpoint):
        check_fit(dep.checkpoint, local)


def check_fit(base: str, adapters: list[str]) -> None:
    """Every adapter's tensors fit the base's modules (the replica's own check, on the base
    built on the meta device: no weights read)."""
    # lazy: transformers' modeling code and torch: only once a command serves adapters
    from moeflow.model.anatomy import load_config_json, meta_model
    from moeflow.serving.adapters import check_compatible

    model, _ = meta_model(load_config_json(base), f"{base}/config.json")
    for source in adapters:
        check_compatible(source, model)


def check_base(path: str, trust_remote_code: bool = False) -> None:
    """The base checkpoint: config.json values, index and every shard's header."""
    if is_uri(path):
        check_readable(path, "model")
        return
    # lazy: transformers (config classes) and the parser: only once a command serves
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.model.remote_code import activate

    if not Path(path).is_dir():
        raise UserError(f"{path}: not a model directory")
    activate(path, trust=trust_remote_code)  # code the checkpoint ships: held to its digests
    read_checkpoint(path)


def check_adapter(name: str, source: str) -> None:
    """A served adapter: its name, adapter_config.json and its weights' header."""
    check_name(name)
    if source.startswith("models:/"):
        return
    if is_uri(source):
        check_readable(source, f"adapter {name}")
        return
    read_adapter_dir(source)
    # lazy: the header parser imports torch (seconds)
    from moeflow.checkpoint.st_io import read_header

    read_header(Path(source) / "adapter_model.safetensors")  # a truncated copy fails here


def replica_failure(message: str) -> str | None:
    """The cause in a Serve deployment's failure message (a replica's formatted traceback):
    its last exception line, a moeflow UserError without its class name; None if none."""
    found = None
    for line in message.splitlines():
        match = _EXC_LINE.match(line.rstrip())
        if match and not match.group(2).startswith("Traceback (most recent call last)"):
            found = match
    if found is None:
        return None
    return found.group(2) if found.group(1) == "UserError" else f"{found.group(1)}: {found.group(2)}"
