-- polar-mitm's datasets in DuckDB alone: calls with whole prompts and requests, traces deduplicated.
--
-- A call that extends an earlier call of its rollout is stored as what it adds (docs/store.md,
-- "Schema and migrations"): prompt_suffix_ids after the first prompt_base_len ids of its base
-- call's prompt + output, request_middle between the first request_base_prefix and the last
-- request_base_suffix characters of its base's request_json; prompt_token_ids / request_json are
-- then null. These macros walk base_call_id (a recursive CTE) and give every call back whole,
-- exactly as polar-mitm's own reader (store.read_table) does, for shards of schema 1, 2 and 3.
--
--   duckdb -c ".read polar.sql" -c "SELECT call_id, len(prompt_token_ids) FROM polar_calls('polar-data')"
--   polar-mitm sql                      # prints this file (polar-mitm sql --path: where it is)
--   polar-mitm sql polar-data "SELECT count(*) FROM calls"   # views calls, traces on a directory
--
-- Shards are immutable and a crash can leave a row in two of them, so each key keeps its last
-- written copy (shards in name order: time, then proxy); a trace keeps its highest revision.
-- `root` is the proxy's polar_output, a local directory (tested; DuckDB's read_parquet also takes
-- remote paths through its own extensions, not tested here).

-- Every calls shard, one row per call_id, with the columns of every schema (older shards lack
-- the later columns: null here), in the order polar-mitm reads them (shard name, row).
CREATE OR REPLACE MACRO polar_calls_stored(root) AS TABLE
    SELECT * EXCLUDE (polar_rank)
    FROM (
        SELECT
            *,
            row_number() OVER (
                PARTITION BY call_id
                ORDER BY regexp_extract(filename, '[^/]*$') DESC, filename DESC, file_row_number DESC
            ) AS polar_rank
        FROM (
            SELECT *
            FROM read_parquet(
                root || '/calls/**/part-*.parquet',
                union_by_name = true, hive_partitioning = true,
                filename = true, file_row_number = true
            )
            UNION ALL BY NAME
            SELECT  -- the columns later schemas added, typed, in case no shard has them
                NULL::VARCHAR AS base_call_id, NULL::INTEGER AS prompt_base_len,
                NULL::INTEGER AS request_base_prefix, NULL::INTEGER AS request_base_suffix,
                NULL::INTEGER[] AS prompt_suffix_ids, NULL::VARCHAR AS request_middle
            WHERE false
        )
    )
    WHERE polar_rank = 1;

-- A call's whole prompt: stored whole (no length n), or the first n of its base's prompt and
-- output ids, then the stored part (schema 2 kept the part under the whole column's name: hence
-- the coalesce). Null when the base's is unknown.
CREATE OR REPLACE MACRO polar_prompt(base_prompt, base_output, n, whole, part) AS
    CASE
        WHEN n IS NULL THEN whole
        WHEN base_prompt IS NULL OR coalesce(part, whole) IS NULL THEN NULL
        WHEN n > len(base_prompt) + coalesce(len(base_output), 0) THEN NULL
        ELSE list_concat(
            list_slice(list_concat(base_prompt, coalesce(base_output, [])), 1, n),
            coalesce(part, whole)
        )
    END;

-- A call's whole request: stored whole (no p), or its base's first p characters, the stored
-- middle, the base's last q.
CREATE OR REPLACE MACRO polar_request(base_request, p, q, whole, middle) AS
    CASE
        WHEN p IS NULL THEN whole
        WHEN base_request IS NULL OR coalesce(middle, whole) IS NULL THEN NULL
        ELSE substring(base_request, 1, p) || coalesce(middle, whole)
            || substring(base_request, length(base_request) - coalesce(q, 0) + 1, coalesce(q, 0))
    END;

-- Every call with its whole prompt_token_ids and request_json; the columns that only say how a
-- row is stored are left out. A call whose base is not among the shards read (one removed by
-- hand) gets null there, as with polar-mitm's reader.
CREATE OR REPLACE MACRO polar_calls(root) AS TABLE
    WITH RECURSIVE
        stored AS (SELECT * FROM polar_calls_stored(root)),
        whole(call_id, prompt, output, request) AS (
            -- calls that rest on no call read here: what they store whole is whole, a part null
            SELECT
                s.call_id,
                polar_prompt(
                    NULL, NULL, s.prompt_base_len, s.prompt_token_ids, s.prompt_suffix_ids
                ),
                s.output_token_ids,
                polar_request(
                    NULL, s.request_base_prefix, s.request_base_suffix, s.request_json,
                    s.request_middle
                )
            FROM stored s
            WHERE s.base_call_id IS NULL
                OR s.base_call_id NOT IN (SELECT call_id FROM stored)
            UNION ALL
            -- then, a level at a time, the calls resting on those
            SELECT
                s.call_id,
                polar_prompt(
                    b.prompt, b.output, s.prompt_base_len, s.prompt_token_ids, s.prompt_suffix_ids
                ),
                s.output_token_ids,
                polar_request(
                    b.request, s.request_base_prefix, s.request_base_suffix, s.request_json,
                    s.request_middle
                )
            FROM whole b
            JOIN stored s ON s.base_call_id = b.call_id
        )
    SELECT
        s.* EXCLUDE (
            base_call_id, prompt_base_len, request_base_prefix, request_base_suffix,
            prompt_suffix_ids, request_middle, filename, file_row_number
        )
        REPLACE (w.prompt AS prompt_token_ids, w.request AS request_json)
    FROM stored s
    LEFT JOIN whole w USING (call_id)
    ORDER BY regexp_extract(s.filename, '[^/]*$'), s.filename, s.file_row_number;

-- Every trace once: the highest revision (a reward join writes a new one), then the last written.
CREATE OR REPLACE MACRO polar_traces(root) AS TABLE
    SELECT * EXCLUDE (polar_rank, filename, file_row_number)
    FROM (
        SELECT
            *,
            row_number() OVER (
                PARTITION BY trace_id
                ORDER BY coalesce(revision, -1) DESC,
                    regexp_extract(filename, '[^/]*$') DESC, filename DESC, file_row_number DESC
            ) AS polar_rank
        FROM read_parquet(
            root || '/traces/**/part-*.parquet',
            union_by_name = true, hive_partitioning = true,
            filename = true, file_row_number = true
        )
    )
    WHERE polar_rank = 1
    ORDER BY regexp_extract(filename, '[^/]*$'), filename, file_row_number;
