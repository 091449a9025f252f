"""The two datasets polar-mitm writes, declared once: `calls/` and `traces/`.

Writers and readers both import these schemas, so a column is added in one place. Bump
`SCHEMA_VERSION` when a column changes meaning or type (adding a nullable column does not
need a bump: readers fill it with nulls); the migration notes live in docs/store.md.
"""

from __future__ import annotations

import pyarrow as pa

# 3: a call stored as what it adds to an earlier one keeps that part under its own name
# (prompt_suffix_ids, request_middle); prompt_token_ids and request_json are whole or null, so a
# plain Parquet reader never gets a part under a whole's name.
# 2: that part stored under prompt_token_ids / request_json (store/delta.py), and the lineage
# columns calls.agent, traces.purpose, traces.agent (nullable).
# 1: whole prompts and requests, no lineage columns (read as null).
# Shards of every version read the same through the store's readers and polar.sql;
# `polar-mitm migrate` rewrites schema 1 and 2 shards as schema 3 (docs/store.md).
SCHEMA_VERSION = 3

_TS = pa.timestamp("us", tz="UTC")
_IDS = pa.list_(pa.int32())
_FLOATS = pa.list_(pa.float32())

CALLS_SCHEMA = pa.schema(
    [
        pa.field("call_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        # proxy_auth | api_key | header | session | client_address (call/identity.py)
        pa.field("rollout_source", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int32()),
        pa.field("session_id", pa.string()),
        pa.field(
            "agent", pa.string()
        ),  # the harness's name for the calling agent (trajectory/lineage.py)
        pa.field("proxy_id", pa.string()),
        pa.field("started_at", _TS),
        pa.field("first_byte_at", _TS),
        pa.field("finished_at", _TS),
        pa.field("dialect", pa.string()),
        pa.field("purpose", pa.string()),  # main | side | count_tokens | ...
        pa.field("method", pa.string()),
        pa.field("host", pa.string()),
        pa.field("path", pa.string()),
        pa.field("stream", pa.bool_()),
        pa.field("upstream_kind", pa.string()),
        pa.field("upstream_url", pa.string()),
        pa.field("route", pa.string()),  # chat | local (answered by the proxy) | token_in
        pa.field("model_requested", pa.string()),
        pa.field("model_served", pa.string()),
        pa.field("policy_version", pa.string()),  # when the call started
        pa.field("policy_version_end", pa.string()),  # when it finished (differs: untrainable)
        pa.field("prompt_token_ids", _IDS),  # the whole prompt; null when stored as a suffix
        pa.field("output_token_ids", _IDS),
        pa.field("output_logprobs", _FLOATS),
        pa.field("ids_source", pa.string()),  # upstream | retokenized | none
        pa.field("count_check", pa.string()),  # ok | mismatch | no_usage
        pa.field("finish_reason", pa.string()),
        pa.field("usage_prompt_tokens", pa.int32()),
        pa.field("usage_completion_tokens", pa.int32()),
        pa.field("usage_json", pa.string()),
        pa.field("status", pa.string()),  # completed | error | client_aborted | incomplete
        pa.field("http_status", pa.int32()),
        pa.field("error", pa.string()),
        pa.field("fidelity_flags", pa.list_(pa.string())),
        pa.field("fidelity_json", pa.string()),
        pa.field("trainable", pa.bool_()),
        pa.field("request_json", pa.string()),  # the harness's request body, redacted; null
        # when stored as request_middle
        pa.field("response_json", pa.string()),  # the reply as the harness received it, assembled
        pa.field("headers_json", pa.string()),  # harness request headers, redacted
        # what the dialect left out translating the request (e.g. a billing-header system block)
        pa.field("translation_notes", pa.list_(pa.string())),
        # schema 2 (store/delta.py): what this call shares with the rollout's previous call
        pa.field("base_call_id", pa.string()),  # that call
        pa.field("prompt_base_len", pa.int32()),  # ids shared with its prompt + output
        pa.field("request_base_prefix", pa.int32()),  # characters shared with its request_json
        pa.field("request_base_suffix", pa.int32()),  # ... at the start, and at the end
        # schema 3: the stored parts under their own names (read whole: store.read_table, polar.sql)
        pa.field("prompt_suffix_ids", _IDS),  # the prompt ids after prompt_base_len
        pa.field("request_middle", pa.string()),  # request_json between the shared ends
        # grammar-constrained sampling (upstream/constraints.py, docs/constrained.md): why the
        # server sampled under a grammar, and output_token_ids[constrained_from:] were
        pa.field("constrained_by", pa.list_(pa.string())),
        pa.field("constrained_from", pa.int32()),
    ]
)

TRACES_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field(
            "revision", pa.int32()
        ),  # a reward join writes a higher revision; readers keep the highest
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int32()),
        pa.field("proxy_id", pa.string()),
        pa.field("role", pa.string()),  # main | sub | side
        pa.field("purpose", pa.string()),  # of its first call: main | compaction | title | ...
        pa.field("agent", pa.string()),  # the harness's agent name (Codex: /root, ...) if any
        pa.field("parent_trace_id", pa.string()),
        pa.field("parent_prefix_len", pa.int32()),
        pa.field("break_reason", pa.string()),
        pa.field("break_detail", pa.string()),  # JSON: the evidence behind break_reason
        pa.field("call_ids", pa.list_(pa.string())),
        pa.field("call_offsets", _IDS),  # start of each call's new tokens in input_ids
        pa.field("input_ids", _IDS),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("logprobs", _FLOATS),
        pa.field("num_policy_tokens", pa.int32()),
        pa.field("num_env_tokens", pa.int32()),
        pa.field("policy_versions", pa.list_(pa.string())),
        pa.field("fidelity_flags", pa.list_(pa.string())),
        pa.field("fidelity_json", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("status", pa.string()),  # completed | incomplete | error
        pa.field("trainable", pa.bool_()),
        pa.field("untrainable_reason", pa.string()),
        pa.field("created_at", _TS),
        # [start, end) pairs, flattened, of input_ids positions sampled under a grammar
        pa.field("constrained_spans", _IDS),
    ]
)

SCHEMAS = {"calls": CALLS_SCHEMA, "traces": TRACES_SCHEMA}
KEYS = {"calls": "call_id", "traces": "trace_id"}
