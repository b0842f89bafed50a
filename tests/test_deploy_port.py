"""deploy.port taken by another program: the deploy falls back to a free port and says so."""

import socket
import time

from moeflow.core.config import validate
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


def test_a_running_serve_keeps_its_port_and_the_url_is_its_own(ray_local):
    """Serve already running on this Ray (an earlier deploy on the cluster) ignores a new port:
    the deploy's URL is the running proxy's (a deploy once smoke-tested a port nothing
    listened on), and it answers there."""
    import httpx
    from ray import serve

    import moeflow.serving.app as app

    first, asked = app.free_port(), app.free_port()
    try:
        assert app._serving_address("127.0.0.1", asked, None, False) == ("127.0.0.1", asked)  # none runs
        serve.start(http_options={"host": "127.0.0.1", "port": first})
        assert app._serving_address("127.0.0.1", asked, None, False) == ("127.0.0.1", first)
        deadline = time.monotonic() + 120
        while True:  # the proxy (or HAProxy in front of it) answers on the first port
            try:
                httpx.get(f"http://127.0.0.1:{first}/-/routes", timeout=5)  # any HTTP answer
                break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"nothing answered on port {first}"
            time.sleep(0.5)
    finally:
        serve.shutdown()
