-- Migration 0005: upgrades the dedup table of 0002_processed_messages_state.sql with
-- the columns result, result_version, fingerprint (NULL for every existing row),
-- what a row remembers for `result = "stored"` and `fingerprint = …`. What
-- `dedup_runtime::migrate` does to a table without them. Safe to run more than once; a
-- catalog change (nullable, no default: no row is rewritten).

ALTER TABLE processed_messages
    ADD COLUMN IF NOT EXISTS result         bytea,
    ADD COLUMN IF NOT EXISTS result_version integer,
    ADD COLUMN IF NOT EXISTS fingerprint    bytea;
