//! Regression fixtures: one module per fixed bug, named after it, each with a comment here
//! that names the bug and the commit that fixed it, and a module doc that says what broke.
//! They run against the real servers (PostgreSQL, MariaDB) and temporary SQLite files,
//! like the rest of the suite. Every fix adds one, in the order of the fixes.

// `#[error(transparent)]` hid the database error from the chain walker: a transient
// error behind it was not retried (and a business-key violation would not have been
// found). Fixed in d1de1dc ("Failure injection on real servers; see through
// #[error(transparent)] wrappers").
#[path = "regressions/thiserror_transparent_source_chain.rs"]
mod thiserror_transparent_source_chain;

// Literals forwarded through `macro_rules!` arrive in invisible groups, which the
// attribute refused as "not a string literal". Fixed in 86eb8f9 ("Cheaper hot paths: no
// span records when nobody listens, no awaited ROLLBACK on a duplicate").
#[path = "regressions/macro_rules_invisible_groups.rs"]
mod macro_rules_invisible_groups;

// The fixes of issue 8, all in 07188d2 ("Core correctness: never report Processed for a
// transaction that did not commit"):

// Defect 1: PostgreSQL answered COMMIT of an aborted transaction with ROLLBACK and no
// error: a body that swallowed a database error got `Processed`, and nothing committed.
#[path = "regressions/postgres_swallowed_error.rs"]
mod postgres_swallowed_error;

// Defect 2: an automatic rollback inside SQLite poisoned the pooled connection
// (`InvalidSavePointStatement` on every later call).
#[path = "regressions/sqlite_automatic_rollback.rs"]
mod sqlite_automatic_rollback;

// Defect 3: MariaDB: a swallowed deadlock left the session in autocommit, so the rest of
// the body committed without its dedup row and the redelivery doubled the effect.
#[path = "regressions/mysql_swallowed_deadlock.rs"]
mod mysql_swallowed_deadlock;

// MariaDB: a handler with a business key and no dedup row (`unique = …` alone) committed
// what its body wrote after a swallowed deadlock, in the new transaction InnoDB's rollback
// left: the order row gone, the rest of the effect there, the redelivery doubled it.
#[path = "regressions/mysql_business_key_swallowed_deadlock.rs"]
mod mysql_business_key_swallowed_deadlock;

// Defect 4: on a lent connection a duplicate only queued its ROLLBACK: the session sat
// idle in a transaction, holding locks.
#[path = "regressions/lent_connection_left_in_transaction.rs"]
mod lent_connection_left_in_transaction;

// Defect 5, the writer's half: MariaDB wrote `processed_at` in the consumer session's
// time zone, so pruning deleted fresh ids.
#[path = "regressions/mysql_claim_time_zone.rs"]
mod mysql_claim_time_zone;

// Defect 5, the pruner's half: MariaDB pruning computed its cutoff in the pruner
// session's time zone.
#[path = "regressions/prune_mysql_time_zone.rs"]
mod prune_mysql_time_zone;

// Defect 6: MariaDB business keys matched another table's unique key of the same name,
// so a message whose work was never done was acknowledged.
#[path = "regressions/mysql_business_key_other_table.rs"]
mod mysql_business_key_other_table;

// Defect 7: integer 42 and text "42" are one message id; the README recommended bare
// Kafka offsets and JetStream sequences as ids, which repeat across partitions.
#[path = "regressions/same_id_integer_and_string.rs"]
mod same_id_integer_and_string;

// Defect 8: `processed_at` was the claim time (on PostgreSQL inside a caller's
// transaction, its BEGIN), not the commit time, so pruning at age = window came early.
#[path = "regressions/processed_at_is_the_commit_time.rs"]
mod processed_at_is_the_commit_time;

// Defect 9: PostgreSQL pruning read timestamps back through the session's `DateStyle` and
// `TimeZone`: a day-first cutoff deleted an id processed a second ago.
#[path = "regressions/prune_postgres_datestyle.rs"]
mod prune_postgres_datestyle;

// Defect 10: `AckPolicy` dead-lettered a message whose session PostgreSQL had ended for
// idling in its transaction (25P03), a transient failure.
#[path = "regressions/ack_idle_in_transaction.rs"]
mod ack_idle_in_transaction;

// The invalid-id error read "error occurred while encoding a value: invalid message id: …",
// sqlx's words for the `Encode` variant that carried it. Fixed in b491750 ("Invalid message
// id: the error's first words say so").
#[path = "regressions/invalid_id_reads_as_an_encoding_error.rs"]
mod invalid_id_reads_as_an_encoding_error;

// `AckPolicy` dead-lettered a stale lease owner's `LeaseLost`, a message another
// delivery had processed: its docs said retry, `Failure::of` said permanent. Fixed with
// this fixture ("AckPolicy: a lost lease is retried, never dead-lettered").
#[path = "regressions/lease_lost_dead_lettered.rs"]
mod lease_lost_dead_lettered;

// The inbox: a message whose handler killed its worker took the rows claimed with it to
// the dead state (each death counted an attempt of all of them, taken over together).
// Fixed in the commit that renews an inbox worker's lease by a heartbeat ("Inbox workers:
// heartbeat, mark at the end, shutdown deadline, one takeover per claim"); since issue 24,
// item 5 ("Inbox and relay: connection faults and stopped claims spend no attempt of rows
// that never started"), the rows claimed with the killer lose no attempt at all.
#[path = "regressions/inbox_killer_buried_its_claim.rs"]
mod inbox_killer_buried_its_claim;

// MariaDB: an inbox claim's bury (and the renewals and releases of the inbox and the
// outbox relay) scanned the state index with locks and deadlocked with a mark by primary
// key; CI saw `process_batch` fail with 1213. Fixed in the commit that adds this fixture
// ("MySQL: inbox and relay updates by state go by primary key").
#[path = "regressions/mysql_bury_deadlocked_with_a_mark.rs"]
mod mysql_bury_deadlocked_with_a_mark;

// Issue 24, items 14, 15 and 16: PostgreSQL's outbox prune failed on a very large age
// (an interval overflow) instead of deleting nothing; SQLite's relay on a missing table
// gave an untyped error (the classifier knew the outbox table's name, not
// `<table>_relay`'s); the README said an empty payload is refused, and it is accepted.
// Fixed in the commit that adds this fixture ("Outbox: a huge prune age deletes
// nothing, the relays' table is a missing table too, empty payloads said accepted").
#[path = "regressions/outbox_prune_age_and_relay_table.rs"]
mod outbox_prune_age_and_relay_table;

// Issue 24, item 13: `Lease::extend` after `Lease::transaction` failed with `LeaseLost`
// (the completion transaction had already marked the row processed, and the renewal
// requires a row in progress). Fixed in the commit that adds this fixture ("Lease::extend
// after the completion transaction: nothing to renew, not a lost lease").
#[path = "regressions/lease_extend_after_transaction.rs"]
mod lease_extend_after_transaction;

// Issue 24, item 1: a plain handler or a batch answered `Duplicate(AlreadyProcessed)`
// (acknowledge) for a row a leased handler held in progress; the conflict branch never
// read the row's state. Fixed in the commit that adds this fixture ("Plain handlers and
// batches read the row they meet: in progress is retried, unknown is unknown").
#[path = "regressions/plain_and_batch_met_a_lease.rs"]
mod plain_and_batch_met_a_lease;

// Issue 24, item 2: MySQL/MariaDB, a nested handler's claim (even a duplicate's)
// overwrote the session variables of the outer handler's checked commit, which then
// failed with 1242 on every attempt. Fixed in the same commit.
#[path = "regressions/nested_duplicate_kept_the_outer_row.rs"]
mod nested_duplicate_kept_the_outer_row;

// Issue 24, item 3: a batch whose one bad message failed only at COMMIT (a deferred
// constraint; on PostgreSQL a swallowed statement error) ended the whole call with the
// error, forever. Fixed in the commit that adds this fixture ("Batches: a failure at
// COMMIT splits down to the message").
#[path = "regressions/batch_failed_at_commit.rs"]
mod batch_failed_at_commit;

// Issue 24, item 4: MariaDB, headers of exactly MAX_HEADERS_LEN did not fit the inbox's
// and the outbox's `headers BLOB` (65,535 bytes): 1406 on a strict server, the last byte
// cut with `sql_mode = ''`. Fixed in the commit that adds this fixture ("MariaDB: inbox
// and outbox headers in MEDIUMBLOB, widened by migrate").
#[path = "regressions/mysql_headers_at_the_limit.rs"]
mod mysql_headers_at_the_limit;

// Issue 24, item 8: an error text with a NUL byte (PostgreSQL 22021) or of 1 MB (MySQL
// TEXT) could not be stored in `last_error`, so the failure was never recorded. Fixed in
// the commit that adds this fixture ("Inbox and outbox: error text stored safely").
#[path = "regressions/inbox_error_text_stored_safely.rs"]
mod inbox_error_text_stored_safely;

// Issue 24, item 11: a PostgreSQL (and SQLite) worker processed its claim in the order
// `UPDATE … RETURNING` gave the rows, not in receive order. Fixed in the commit that adds
// this fixture ("Inbox: a claim is processed in receive order on every backend").
#[path = "regressions/inbox_claim_in_receive_order.rs"]
mod inbox_claim_in_receive_order;

// Issue 24, item 7: overlapping `receive_batch` calls inserted in the callers' orders and
// deadlocked (PostgreSQL 40P01, MariaDB 1213), the error reaching the caller. Fixed in the
// commit that adds this fixture ("Inbox receive_batch: rows in key order, transient
// failures retried; MariaDB splits by max_allowed_packet"). On MariaDB the retries ran out
// under CI's load (duplicates locked exclusively, batches deadlocking again on stored ids):
// fixed in "MariaDB receive_batch: stored ids read first, left out of the insert".
#[path = "regressions/receive_batch_overlapping_deadlocked.rs"]
mod receive_batch_overlapping_deadlocked;

// Issue 24, item 6: MariaDB's `receive_batch` split by rows only: 20 messages of 1 MiB
// went over `max_allowed_packet` and reset the connection on every delivery. Fixed in the
// same commit.
#[path = "regressions/receive_batch_over_max_allowed_packet.rs"]
mod receive_batch_over_max_allowed_packet;

// Issue 24, item 9: PostgreSQL, `Relay::run` and `Worker::run` held one of the pool's
// connections for their LISTEN: on a pool of one, every claim timed out, forever. Fixed
// in the commit that adds this fixture ("PostgreSQL: the hints' listener on a connection
// of its own, outside the pool").
#[path = "regressions/one_connection_pool_listener.rs"]
mod one_connection_pool_listener;

// Issue 24, item 10: at shutdown, an inbox worker released its claim's unstarted rows
// only after the message in hand finished. Fixed in the commit that adds this fixture
// ("Inbox shutdown: the unstarted rows released at the signal").
#[path = "regressions/inbox_shutdown_released_late.rs"]
mod inbox_shutdown_released_late;

// Issue 24, item 18: a worker's or relay's heartbeat as long as its lease, or longer,
// silently turned renewal off. Fixed in the commit that adds this fixture ("Workers and
// relays refuse a heartbeat not shorter than the lease").
#[path = "regressions/heartbeat_not_under_lease.rs"]
mod heartbeat_not_under_lease;

// Issue 24, item 12: the outbox docs promised enqueue order per ordering key; the relay
// sends in the order a reader can see (a message enqueued after another of its key
// committed goes after it). Fixed in the docs, with this fixture ("Ordering keys: the
// order promised is the order a reader can see, tested with concurrent producers").
#[path = "regressions/outbox_order_is_commit_order.rs"]
mod outbox_order_is_commit_order;

// Issue 24, item 19: SQLite, a receipt waits behind a worker's handler transaction (the
// only write lock) up to the busy timeout; the docs did not say so. Fixed in the docs,
// with this fixture checking the documented bound ("SQLite inbox: a receipt waits for the
// handler in hand, said and tested").
#[path = "regressions/sqlite_receive_behind_a_handler.rs"]
mod sqlite_receive_behind_a_handler;

// Issue 24, item 17: the outbox's metrics had no label telling two outbox tables apart,
// and the inbox's and the relay's batch counters missed what a batch committed before
// it ended with an error. Fixed in the commit that adds this fixture ("Metrics: the
// outbox's carry its table; batches count what they did before an error").
#[path = "regressions/metrics_outbox_table_and_early_error.rs"]
mod metrics_outbox_table_and_early_error;

// Issue 24, item 4, the rest of the audit: every documented limit of the inbox and the
// outbox at exactly the limit and one over, on every backend and on MariaDB with
// `sql_mode = ''` too. No column was found short beyond the headers; this fixture keeps
// it so ("Limits: each at the limit and one over, on every column of every backend").
#[path = "regressions/limits_fit_every_column.rs"]
mod limits_fit_every_column;

// Issue 24, item 5: a stopped worker's or relay's claim was taken over one row per claim,
// each counting another attempt, so rows that never started lost attempts and were buried
// "the worker stopped". Fixed in "Inbox and relay: connection faults and stopped claims
// spend no attempt of rows that never started" (taken back in bulk; only the row in hand
// keeps its attempt).
#[path = "regressions/stopped_claim_taken_back_in_bulk.rs"]
mod stopped_claim_taken_back_in_bulk;

// Issue 24, item 5: a claim whose reply was lost failed the call and left its rows held
// with an attempt counted; a connection cut under the worker's COMMIT counted as the
// message's failure. Fixed in the same commit (claims tried again under the same owner
// token, finding the rows they took; the worker's own statements tried again after a lost
// connection).
#[path = "regressions/connection_faults_spend_no_attempt.rs"]
mod connection_faults_spend_no_attempt;

// The pipelined relay (issue 25) sent a whole claim before marking any row; a relay
// stopped mid-claim had every row unmarked, and the take-back charged the first one in the
// claim's order at every stop — an innocent row dead after its attempts while the row that
// stopped the relay went on. Fixed by sending a row on a later attempt alone, in its place
// in the claim's order (the inbox's batch mode does the same).
#[path = "regressions/relay_stopper_charged_innocents.rs"]
mod relay_stopper_charged_innocents;

// Issues 25 and 26: on PostgreSQL the outbox's and the inbox's `migrate` ran an
// `ALTER TABLE … ADD COLUMN IF NOT EXISTS` (traceparent, fingerprint) every time, after a
// `CREATE INDEX IF NOT EXISTS` in the same transaction: a service starting beside a
// running worker deadlocked with it. Fixed in "Inbox fingerprints; migrate adds a column
// only when the catalog lacks it" (schema::postgres::add_missing).
#[path = "regressions/migrate_deadlocked_writers.rs"]
mod migrate_deadlocked_writers;

// Issue 26: on PostgreSQL a claim that found its row read `state` and `expires_at`
// through `to_jsonb(p)`, converting the whole row — a stored result of 1 MB cost every
// duplicate 9 ms. Fixed in "PostgreSQL claims read state and expires_at by name once the
// table has them" (schema::postgres::upgraded).
#[path = "regressions/duplicate_claim_converted_the_whole_row.rs"]
mod duplicate_claim_converted_the_whole_row;

// Issue 26 (seen in CI): on MariaDB/MySQL `migrate` ran `ALTER TABLE … ALTER COLUMN
// processed_at SET DEFAULT (UTC_TIMESTAMP(6))` every time, which waits for an exclusive
// metadata lock behind any open transaction on the dedup table while every later claim
// queues behind it. Fixed in "MySQL migrate alters the dedup table only when the catalog
// says so" (schema::mysql::utc_by_default).
#[path = "regressions/mysql_migrate_waited_for_open_transactions.rs"]
mod mysql_migrate_waited_for_open_transactions;

// Issue 26 (found with the MySQL defect above): on PostgreSQL `migrate` ran `CREATE INDEX
// IF NOT EXISTS` on every call (the dedup table's `…_processed_at_idx`, the inbox's and
// the outbox's indexes), which takes its `SHARE` lock before it looks: it waited for every
// open writer, and every writer after it queued behind it. Fixed in "PostgreSQL migrate
// creates an index only when the catalog lacks it" (schema::postgres::create_locked).
#[path = "regressions/migrate_waited_for_open_writers.rs"]
mod migrate_waited_for_open_writers;

// The RabbitMQ and NATS examples in batch mode dropped `FORWARD_TO` without a word (a
// two-hop service A that never sent its events). Fixed in 9431b0b ("RabbitMQ and NATS
// examples refuse BATCH with FORWARD_TO; README names dedup-ui").
#[cfg(feature = "brokers")]
#[path = "regressions/batch_examples_dropped_forward_to.rs"]
mod batch_examples_dropped_forward_to;

// Issue 39, item 3: `receive_batch` answered the second copy of an id refused for its
// stored fingerprint `DuplicateInBatch` (acknowledge) while `receive` refused the same
// copy. Fixed in "receive_batch refuses every copy of a mismatching id".
#[path = "regressions/receive_batch_acknowledged_a_mismatch_copy.rs"]
mod receive_batch_acknowledged_a_mismatch_copy;

// Issue 39, item 7: a mark whose reply was lost (committed by the server) was tried
// again, found none of its rows still claimed, and the relay counted its own rows `lost`.
// Fixed in "A retried relay mark counts the rows sent under its claim".
#[path = "regressions/relay_lost_mark_reply_counted_lost.rs"]
mod relay_lost_mark_reply_counted_lost;

// Issue 39, item 4: a row claimed under a send-first lease without a fingerprint (a
// rolling upgrade), its owner dead, taken over by a leased or a batch handler with
// `fingerprint = …`: the take-over wrote no fingerprint, and a later copy with another
// payload was `Replayed` / `Duplicate` instead of a mismatch. Fixed in the commit that adds
// this fixture ("Take-overs write the fingerprint as the first claim does").
#[path = "regressions/takeover_kept_no_fingerprint.rs"]
mod takeover_kept_no_fingerprint;

// Issue 39, item 1: the RabbitMQ publisher took a returned (unroutable) message for the
// return of whichever confirm completed next: unroutable rows marked sent, routed rows
// failed. Fixed in "RabbitMQ publisher: returns matched by message-id; it owns and
// renews its connection".
#[cfg(feature = "brokers")]
#[path = "regressions/rabbitmq_return_pinned_on_the_wrong_row.rs"]
mod rabbitmq_return_pinned_on_the_wrong_row;

// Issue 39, item 2: after a broker restart or a cut connection the RabbitMQ and Redis
// Streams publishers failed every later claim, and the relay buried every row after its
// attempts. Fixed in "Every publisher connects again; an unreachable broker costs no
// attempt" (with the RabbitMQ publisher's own connection in ee7edf8).
#[cfg(feature = "brokers")]
#[path = "regressions/publishers_died_with_their_connection.rs"]
mod publishers_died_with_their_connection;

// Issue 39, item 6: the JetStream publisher awaited a claim's acknowledgements one after
// the other, each with its own time-out: a stalled server held a claim for one time-out
// per message. Fixed in "JetStream publisher: one deadline per claim".
#[cfg(feature = "brokers")]
#[path = "regressions/jetstream_stall_held_a_claim_per_message.rs"]
mod jetstream_stall_held_a_claim_per_message;

// Issue 39, item 4, the downgrade direction: a row printed by its first claim under a
// send-first lease, its owner dead, taken over by a plain handler with `result = "stored"`
// and no fingerprint: its store wrote `fingerprint = NULL`, and a later copy with another
// payload was a duplicate instead of a mismatch. Fixed in "A handler without a fingerprint
// keeps the one its row has".
#[path = "regressions/fingerprint_erased_by_a_handler_without_one.rs"]
mod fingerprint_erased_by_a_handler_without_one;

// Issue 39, item 5: `Prune::run`, `run_inbox`, `run_outbox` and `Inbox::prune` returned
// futures that were not `Send` (the one loop of every prune took an `AsyncFnMut` that
// borrowed, whose futures rustc cannot prove `Send` for every lifetime): a prune could not
// be `tokio::spawn`ed. Fixed in the commit that adds this fixture ("Prunes can be
// spawned: the run loop drives a trait with a Send future, not an AsyncFnMut").
#[path = "regressions/prunes_could_not_be_spawned.rs"]
mod prunes_could_not_be_spawned;

// Issue 39, item 4, left open by the take-over fixes: on PostgreSQL a plain handler with
// `fingerprint = …` read its row (an expired send-first lease, unprinted) without a lock;
// another delivery took the row over with another payload, and once that lease was over
// too, the plain take-over, which checked no fingerprint, processed the message over the
// row's, the mismatch unreported. Fixed in "The plain take-over refuses a row printed with
// another fingerprint".
#[path = "regressions/plain_takeover_raced_a_printed_claim.rs"]
mod plain_takeover_raced_a_printed_claim;

// Issue 40: `KafkaConsumer::run_batches` with `offsets_in_database(true)` kept no position
// in the database, silently (only the plain form writes it). Fixed in "Crash harnesses on
// the batch form of all five consumers; Kafka refuses offsets in the database with
// run_batches": refused at start.
#[cfg(feature = "brokers")]
#[path = "regressions/kafka_batches_ignored_offsets_in_database.rs"]
mod kafka_batches_ignored_offsets_in_database;

// Issue 40: the hosted MQTT consumer kept rumqttc's default 10 KiB packet limit: a larger
// message failed the connection each time it came, and the subscription stuck behind it.
// Fixed in "MQTT 5 for the consumer and the publisher": MQTT's own limit announced.
#[cfg(feature = "brokers")]
#[path = "regressions/mqtt_consumer_choked_on_a_message_over_10_kib.rs"]
mod mqtt_consumer_choked_on_a_message_over_10_kib;

// Issue 40: MQTT 3.1.1's `PUBACK` cannot say that nobody was subscribed: a row (or a dead
// letter) that went nowhere was marked sent (acknowledged). Fixed in "MQTT 5 for the
// consumer and the publisher": the `PUBACK`'s reason code is read.
#[cfg(feature = "brokers")]
#[path = "regressions/mqtt_sent_to_no_subscriber.rs"]
mod mqtt_sent_to_no_subscriber;

// Issue 42: `migrate` at a start with nothing to do logged four INFO lines on PostgreSQL
// ("relation … already exists, skipping": the server's notices of `CREATE TABLE IF NOT
// EXISTS`, which sqlx logs at INFO). Fixed in "0.1 without deprecated names, a quiet
// migrate": the migration's transaction turns notices below a warning off.
#[path = "regressions/migrate_logged_notices_at_every_start.rs"]
mod migrate_logged_notices_at_every_start;

// Issue 40 (seen in CI): the hosted RabbitMQ consumer awaited an acknowledgement lapin
// never answers when the connection fails as it is sent, and hung there: it never connected
// again. Fixed in the commit that adds this fixture ("RabbitMQ: a settlement cut off with
// its connection counts as not sent").
#[cfg(feature = "brokers")]
#[path = "regressions/rabbitmq_settlement_lost_with_its_connection.rs"]
mod rabbitmq_settlement_lost_with_its_connection;
