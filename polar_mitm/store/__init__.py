"""The durable store: journal (fsync) -> Parquet shards, and the readers of those shards.

    store = Store(output="./polar-data")    # or "s3://bucket/prefix?…" with journal_dir=<local dir>
    report = store.start()                  # recovers what a crashed run left (RecoveryReport)
    seq = store.append("calls", row)        # non-blocking, never raises
    store.sync()                            # rows are in the fsynced journal ("captured")
    store.journaled(seq)                    # the same as a future (for an event loop)
    store.flush()                           # rows are in durable Parquet shards
    store.close()                           # flush, stop; idempotent, safe from atexit
    read_table("./polar-data", "calls")     # all shards, deduplicated

On disk::

    <output>/calls/date=YYYY-MM-DD/part-<utc ts>-<proxy_id>-<segment>.parquet
    <output>/traces/date=YYYY-MM-DD/part-…parquet
    <journal_dir>/seg-<n:08d>.log      journal segments, trimmed once their rows are in shards
    <journal_dir>/committed            manifest: (segment, dataset) pairs already in shards,
                                       and the shards of a round in progress (intents)
    <journal_dir>/rejected.log         rows that can never fit the schema (journal framing)
    <journal_dir>/proxy_id, LOCK       this proxy's stable id; the single-writer lock

``journal_dir`` defaults to ``<output>/_journal`` for local output (a ``_`` name, so dataset
readers skip it). Details: `journal` (record framing, manifest), `shards` (atomic publication,
row-group size), `recovery` (crash rules), `writer` (threads, thresholds, retries), `remote`
(the s3:// form of the output), `reader`; the user-facing contract is docs/store.md.
"""

from .reader import dedupe, list_shards, read_table
from .recovery import RecoveryReport
from .schema import CALLS_SCHEMA, KEYS, SCHEMA_VERSION, SCHEMAS, TRACES_SCHEMA
from .writer import Store, recover

__all__ = [
    "CALLS_SCHEMA",
    "KEYS",
    "SCHEMAS",
    "SCHEMA_VERSION",
    "TRACES_SCHEMA",
    "RecoveryReport",
    "Store",
    "dedupe",
    "list_shards",
    "read_table",
    "recover",
]
