"""An S3-compatible server for tests: moto's server mode on 127.0.0.1, a free port.

    with s3_server() as env:   # env: AWS_* variables pointing at it (a bucket "moeflow")
        ...

Started as its own process group and stopped by that group's id (never by name).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

from moeflow.core.ports import free_port

BUCKET = "moeflow"


def _start(port: int, log) -> subprocess.Popen | None:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            return None  # the port was taken after all: try another
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2)
            return proc
        except OSError:
            time.sleep(0.2)
    _stop(proc)
    return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def credentials(port: int) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}


@contextmanager
def s3_server(log_path: str = os.devnull, bucket: str = BUCKET):
    """Run moto's S3 server; yields the AWS_* environment for it, with `bucket` created.
    fsspec caches its S3 clients with the endpoint they read at creation: the cache is
    cleared on entry and exit, so no client of an earlier server (a dead port) is reused."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # each fsspec class caches its own instances
    with open(log_path, "ab") as log:
        for _ in range(5):
            port = free_port()
            proc = _start(port, log)
            if proc is not None:
                break
        else:
            raise RuntimeError("moto server did not start on 5 free ports")
        env = credentials(port)
        try:
            import boto3

            boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                         aws_access_key_id="testing", aws_secret_access_key="testing"
                         ).create_bucket(Bucket=bucket)
            yield env
        finally:
            _stop(proc)
            s3fs.S3FileSystem.clear_instance_cache()
