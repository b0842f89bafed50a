"""deploy.port taken by another program: the deploy falls back to a free port and says so."""

import socket

from moeflow.config import validate
from moeflow.serving import launch as D


def test_port_taken_sees_a_listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert D.port_taken("127.0.0.1", port)
    assert not D.port_taken("127.0.0.1", port)


def test_deploy_falls_back_to_a_free_port_with_one_line(monkeypatch, tmp_path):
    import moeflow.serving.app as app

    started, lines = {}, []

    def start(settings, *, host, port, **kwargs):
        started["port"] = port
        return f"http://{host}:{port}"

    monkeypatch.setattr(app, "start", start)
    monkeypatch.setattr(D, "smoke_test", lambda url, key, n, wait: {"models": [{"id": "m"}]})
    settings = type("S", (), {"api_key": None, "merge": None})()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        cfg = validate({"model": {"path": str(tmp_path)}, "deploy": {"port": busy}})
        record = D.deploy(cfg, settings, notify=lines.append)
    assert started["port"] != busy and record["url"] == f"http://127.0.0.1:{started['port']}"
    assert lines == [f"port {busy} is in use; serving on {record['url']} instead "
                     "(set deploy.port to choose one)"]
    lines.clear()
    cfg = validate({"model": {"path": str(tmp_path)}, "deploy": {"port": busy}})  # now free
    assert D.deploy(cfg, settings, notify=lines.append)["url"].endswith(f":{busy}") and not lines
