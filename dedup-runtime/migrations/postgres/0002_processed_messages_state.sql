-- Migration 0002: upgrades the dedup table of 0001_processed_messages.sql with the
-- columns state, owner, expires_at (NULL for every existing row: processed) and an
-- index of the rows not processed. What `dedup_runtime::migrate` does to a table
-- without them. Safe to run more than once. Consumers wait while it runs: it checks the new
-- CHECK and builds the partial index with one scan of the table each.

ALTER TABLE processed_messages
    ADD COLUMN IF NOT EXISTS state        smallint CHECK (state IN (1, 2)),
    ADD COLUMN IF NOT EXISTS owner        bytea,
    ADD COLUMN IF NOT EXISTS expires_at   timestamptz;
CREATE INDEX IF NOT EXISTS processed_messages_unresolved_idx ON processed_messages (consumer, state, expires_at) WHERE state IS NOT NULL;
