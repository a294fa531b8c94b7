-- Migration 0005: upgrades the dedup table of 0002_processed_messages_state.sql with
-- the columns result, result_version, fingerprint (NULL for every existing row),
-- what a row remembers for `result = "stored"` and `fingerprint = …`. What
-- `dedup_runtime::migrate` does to a table without them. SQLite has no ADD COLUMN IF NOT
-- EXISTS: run it once (as migration tools do).

ALTER TABLE processed_messages ADD COLUMN result         BLOB;
ALTER TABLE processed_messages ADD COLUMN result_version INTEGER;
ALTER TABLE processed_messages ADD COLUMN fingerprint    BLOB;
