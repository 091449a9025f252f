"""An S3-compatible server on loopback for tests: moto's standalone server, in a thread.

moto keeps its buckets in process-wide state, so `stop()` then `start()` on the same port is an
outage of the endpoint that loses no data — what a real object store's blip looks like.
"""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

# Fake credentials: the proxy gets them from the environment, and they must never reach disk.
ACCESS_KEY = "AKIAPOLARTESTKEY0001"
SECRET_KEY = "polar-s3-secret-never-on-disk-7f3a"
REGION = "us-east-1"


class MotoS3:
    def __init__(self, port: int = 0) -> None:
        from moto.server import ThreadedMotoServer

        self._cls = ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.server.stop()
            self.running = False

    def start(self) -> None:
        """Come back on the same port, with the same buckets."""
        if not self.running:
            self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
            self.server.start()
            self.running = True

    def uri(self, bucket: str, prefix: str = "", **extra: str) -> str:
        query = f"endpoint_override={self.host}:{self.port}&scheme=http&region={REGION}"
        query += "".join(f"&{k}={v}" for k, v in extra.items())
        return f"s3://{bucket}/{prefix}?{query}"

    def filesystem(self, bucket: str | None = None) -> pafs.S3FileSystem:
        """The test's (the trainer's) own client, credentials explicit so that it pickles into
        other processes (Ray workers) whole; with ``bucket``, create it first."""
        fs = pafs.S3FileSystem(
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            region=REGION,
            scheme="http",
            endpoint_override=f"{self.host}:{self.port}",
            allow_bucket_creation=True,
        )
        if bucket is not None:
            fs.create_dir(bucket)
        return fs


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials the way a user gives them: the AWS SDK's environment variables (child
    processes such as mitmdump inherit them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


@pytest.fixture
def moto_s3(s3_env):
    server = MotoS3()
    yield server
    server.stop()
