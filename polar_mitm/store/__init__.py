"""The durable store: journal (fsync) -> Parquet shards, and the readers of those shards.

    store = Store(output="./polar-data")
    report = store.start()              # recovers what a crashed run left
    store.append("calls", row)          # non-blocking, never raises
    store.sync()                        # rows are in the fsynced journal ("captured")
    store.flush()                       # rows are in durable Parquet shards
    store.close()
    read_table("./polar-data", "calls")

See DESIGN.md "Records (Parquet)" and docs/store.md for the on-disk layout.
"""

from .reader import dedupe, list_shards, read_table
from .recovery import RecoveryReport, recover
from .schema import CALLS_SCHEMA, KEYS, SCHEMA_VERSION, SCHEMAS, TRACES_SCHEMA
from .writer import Store

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
