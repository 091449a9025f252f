"""Remote output: the s3:// form of polar_output, against moto's S3 server on loopback.

The proxy runs as a real mitmdump with a local journal; shards go to the bucket; the bucket goes
away and comes back; pyarrow reads the shards back. Credentials come from the environment only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from polar_mitm.store import SCHEMA_VERSION, Store, list_shards, read_table
from polar_mitm.store.journal import list_segments
from polar_mitm.store.remote import (
    DEFAULT_RETRIES,
    RemoteOutputError,
    display_uri,
    s3_filesystem,
)
from tests.e2e.loopback.test_capture_e2e import SCENARIO
from tests.helpers.clients import grep_bytes, http_client
from tests.helpers.s3 import ACCESS_KEY, SECRET_KEY, MotoS3
from tests.helpers.waits import wait_until

# -- the URI form --------------------------------------------------------------------------------


def test_credentials_in_the_uri_are_refused_without_echoing_them() -> None:
    for uri in (
        f"s3://{ACCESS_KEY}:{SECRET_KEY}@bucket/prefix",
        f"s3://bucket/prefix?access_key={ACCESS_KEY}&secret_key={SECRET_KEY}",
    ):
        with pytest.raises(RemoteOutputError) as info:
            s3_filesystem(uri)
        message = str(info.value)
        assert "AWS_ACCESS_KEY_ID" in message
        assert SECRET_KEY not in message and ACCESS_KEY not in message
        assert SECRET_KEY not in display_uri(uri) and ACCESS_KEY not in display_uri(uri)


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("endpoint=x", "unknown query key 'endpoint'"),
        ("retries=0", "retries='0' must be positive"),
        ("connect_timeout=soon", "is not a number"),
        ("scheme=ftp", "is not http or https"),
        ("allow_bucket_creation=maybe", "is not true or false"),
    ],
)
def test_bad_query_keys_are_one_clear_error(query: str, error: str) -> None:
    with pytest.raises(RemoteOutputError, match=error):
        s3_filesystem(f"s3://bucket/prefix?{query}")
    with pytest.raises(ValueError, match=error):  # what StoreAddon turns into its one line
        Store(f"s3://bucket/prefix?{query}", journal_dir="/tmp/unused")


def test_bucket_and_prefix_become_the_root() -> None:
    _, root = s3_filesystem("s3://bucket/a/b/?region=eu-west-1")
    assert root == "bucket/a/b"
    _, root = s3_filesystem("s3://bucket")
    assert root == "bucket"


def test_a_dead_endpoint_fails_an_upload_fast(s3_env) -> None:
    """The AWS client's default retries make a failed upload take seconds per attempt; the
    store retries by itself (rows stay in the journal), so one upload must give up quickly:
    after DEFAULT_RETRIES attempts (2: one jittered backoff of up to ~1 s; pyarrow's own 3 take
    ~2.7 s against a refused port, more against a silent one). Counted at an endpoint that
    hangs up on every connection, not timed: a busy machine makes any attempt slow."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        attempts = []
        threading.Thread(target=_hang_up_on_all, args=(listener, attempts), daemon=True).start()
        port = listener.getsockname()[1]
        fs, _ = s3_filesystem(f"s3://bucket/p?endpoint_override=127.0.0.1:{port}&scheme=http")
        with pytest.raises(OSError), fs.open_output_stream("bucket/p/x.parquet") as out:
            out.write(b"x")
    assert len(attempts) == DEFAULT_RETRIES == 2


def _hang_up_on_all(listener: socket.socket, attempts: list) -> None:
    with contextlib.suppress(OSError):  # the listener closed: the test is over
        while True:
            conn, _ = listener.accept()
            attempts.append(conn.getpeername())
            conn.close()


# -- through the proxy ---------------------------------------------------------------------------


def _call(mitm, rollout: str) -> None:
    with http_client(mitm) as client:
        r = client.post(
            "https://api.openai.com/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer polar-{rollout}"},
        )
    assert r.status_code == 200, r.text


def test_s3_output_survives_an_outage_and_reads_back(
    tmp_path: Path, make_mitm, make_policy_server, moto_s3: MotoS3
) -> None:
    fs = moto_s3.filesystem("polar-test")
    server = make_policy_server(SCENARIO)
    journal = tmp_path / "journal"
    mitm = make_mitm(
        server.url,
        polar_output=moto_s3.uri("polar-test", "run"),
        polar_journal=journal,
        polar_flush_rows=1,
        polar_flush_seconds=0.1,
    )
    mitm.proc.wait_for("polar-mitm: writing to s3://polar-test/run")

    def in_bucket() -> set[str]:
        return set(
            read_table("polar-test/run", "calls", filesystem=fs).column("rollout_id").to_pylist()
        )

    for i in range(2):
        _call(mitm, f"s3.{i}")
    wait_until(lambda: in_bucket() == {"s3.0", "s3.1"}, "both rollouts' shards in the bucket")

    moto_s3.stop()
    for i in range(2, 5):
        _call(mitm, f"s3.{i}")  # the harness does not notice: capture is local
    mitm.proc.wait_for(r"writing calls shards failed \(rows kept in the journal, retrying\)")
    assert list_segments(str(journal))
    assert set(grep_bytes(journal, ["s3.2", "s3.3", "s3.4"])) == {"s3.2", "s3.3", "s3.4"}

    moto_s3.start()  # the same bucket comes back: the proxy's own retry uploads the backlog
    wait_until(lambda: len(in_bucket()) == 5, "five rollouts' shards in the bucket")
    assert mitm.stop() == 0
    assert not list_segments(str(journal))

    log = mitm.proc.output()
    assert SECRET_KEY not in log and ACCESS_KEY not in log
    assert grep_bytes(journal, [SECRET_KEY, ACCESS_KEY]) == {}
    paths = list_shards("polar-test/run", "calls", filesystem=fs)
    assert len(paths) >= 3 and all(p.startswith("polar-test/run/calls/date=") for p in paths)
    for path in paths:
        with fs.open_input_file(path) as f:
            data = f.read()
        assert SECRET_KEY.encode() not in data and ACCESS_KEY.encode() not in data
        meta = pq.read_metadata(path, filesystem=fs).metadata
        assert meta[b"schema_version"] == str(SCHEMA_VERSION).encode()
    # plain pyarrow, as a trainer would read it
    table = ds.dataset(
        "polar-test/run/calls", filesystem=fs, format="parquet", partitioning="hive"
    ).to_table()
    assert sorted(table.column("rollout_id").to_pylist()) == [f"s3.{i}" for i in range(5)]
    assert all(n > 0 for n in table.column("usage_completion_tokens").to_pylist())
    assert "date" in table.column_names
