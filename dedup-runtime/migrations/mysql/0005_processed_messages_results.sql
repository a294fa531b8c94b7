-- Migration 0005: upgrades the dedup table of 0002_processed_messages_state.sql with
-- the columns result, result_version, fingerprint (NULL for every existing row),
-- what a row remembers for `result = "stored"` and `fingerprint = …`. What
-- `dedup_runtime::migrate` does to a table without them. MariaDB: safe to run more than once;
-- on 10.11 the ALTER is ALGORITHM=INSTANT. MySQL 8 has no ADD COLUMN IF NOT EXISTS:
-- delete the three `IF NOT EXISTS` and run it once (as migration tools do).

ALTER TABLE processed_messages
    ADD COLUMN IF NOT EXISTS result         LONGBLOB NULL,
    ADD COLUMN IF NOT EXISTS result_version INT NULL,
    ADD COLUMN IF NOT EXISTS fingerprint    BINARY(32) NULL;
