-- Migration 0002: upgrades the dedup table of 0001_processed_messages.sql with the
-- columns state, owner, expires_at (NULL for every existing row: processed) and an
-- index of the rows not processed. What `dedup_runtime::migrate` does to a table
-- without them. SQLite has no ADD COLUMN IF NOT EXISTS: run it once (as migration tools do).

ALTER TABLE processed_messages ADD COLUMN state        INTEGER CHECK (state IN (1, 2));
ALTER TABLE processed_messages ADD COLUMN owner        BLOB;
ALTER TABLE processed_messages ADD COLUMN expires_at   TEXT;
CREATE INDEX IF NOT EXISTS processed_messages_unresolved_idx ON processed_messages (consumer, state, expires_at) WHERE state IS NOT NULL;
