-- The inbox table of dedup-runtime (migration 0003): what `dedup_runtime::inbox::migrate`
-- creates. Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer        text COLLATE "C" NOT NULL,
    message_id      text COLLATE "C" NOT NULL,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    payload         bytea,
    headers         bytea,
    ordering_key    text COLLATE "C",
    received_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    state           smallint NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    owner           bytea,
    lease_until     timestamptz,
    last_error      text,
    processed_at    timestamptz,
    fingerprint     bytea,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS inbox_messages_pending_idx ON inbox_messages (consumer, next_attempt_at, seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS inbox_messages_ordering_idx ON inbox_messages (consumer, ordering_key, seq) WHERE ordering_key IS NOT NULL AND state <> 2;
CREATE INDEX IF NOT EXISTS inbox_messages_claimed_idx ON inbox_messages (consumer, lease_until) WHERE state = 1;
CREATE INDEX IF NOT EXISTS inbox_messages_processed_idx ON inbox_messages (processed_at) WHERE state = 2;
CREATE INDEX IF NOT EXISTS inbox_messages_dead_idx ON inbox_messages (consumer, seq) WHERE state = 3;
