-- Migration 0002: upgrades the dedup table of 0001_processed_messages.sql with the
-- columns state, owner, expires_at (NULL for every existing row: processed). What
-- `dedup_runtime::migrate` does to a table without them; no index (MySQL has no partial index,
-- and every claim would pay for a full one). MariaDB: safe to run more than once; on
-- 10.11 the ALTER is ALGORITHM=INSTANT. MySQL 8 has no ADD COLUMN IF NOT EXISTS:
-- delete the three `IF NOT EXISTS` and run it once (as migration tools do).

ALTER TABLE processed_messages
    ADD COLUMN IF NOT EXISTS state        TINYINT NULL CHECK (state IN (1, 2)),
    ADD COLUMN IF NOT EXISTS owner        BINARY(16) NULL,
    ADD COLUMN IF NOT EXISTS expires_at   DATETIME(6) NULL;
