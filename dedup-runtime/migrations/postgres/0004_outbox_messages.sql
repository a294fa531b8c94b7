-- The outbox table of dedup-runtime (migration 0004): what `dedup_runtime::outbox::migrate`
-- creates. Copy it into your own migrations; it is safe to run more than once.

CREATE TABLE IF NOT EXISTS outbox_messages (
    id              uuid PRIMARY KEY,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    consumer        text COLLATE "C" NOT NULL,
    cause_id        text COLLATE "C" NOT NULL,
    slot            text COLLATE "C" NOT NULL,
    destination     text COLLATE "C" NOT NULL,
    payload         bytea NOT NULL,
    headers         bytea,
    ordering_key    text COLLATE "C",
    traceparent     text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    state           smallint NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    owner           bytea,
    lease_until     timestamptz,
    last_error      text,
    sent_at         timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_messages_unsent_idx ON outbox_messages (next_attempt_at, seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS outbox_messages_ordering_idx ON outbox_messages (ordering_key, seq) WHERE ordering_key IS NOT NULL AND state <> 2;
CREATE INDEX IF NOT EXISTS outbox_messages_claimed_idx ON outbox_messages (lease_until) WHERE state = 1;
CREATE INDEX IF NOT EXISTS outbox_messages_sent_idx ON outbox_messages (sent_at) WHERE state = 2;
CREATE INDEX IF NOT EXISTS outbox_messages_dead_idx ON outbox_messages (seq) WHERE state = 3;
CREATE TABLE IF NOT EXISTS outbox_messages_relay (
    id        smallint PRIMARY KEY CHECK (id = 1),
    last_seen timestamptz NOT NULL
);
