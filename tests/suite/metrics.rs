//! The metrics a call records through the `metrics` facade (feature `metrics`), read
//! back with `metrics-util`'s debugging recorder: one recorder per test, installed for
//! the test's thread only (`with_local_recorder` around a current-thread runtime), so
//! that tests running in parallel do not see each other's counts. Each test also checks
//! the database: the counts describe what the tables hold.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};

use dedup_runtime::{Duplicate, InvalidMessageId, Outcome, idempotent};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Runs `test` with a recorder of its own; returns what it recorded.
fn recorded(test: impl Future<Output = ()>) -> Metrics {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    metrics::with_local_recorder(&recorder, || runtime.block_on(test));
    Metrics::of(&snapshotter)
}

/// A metric's labels, sorted.
type Labels = Vec<(String, String)>;

/// One snapshot: `(name, labels, value)`.
struct Metrics(Vec<(String, Labels, DebugValue)>);

impl Metrics {
    fn of(snapshotter: &Snapshotter) -> Self {
        Metrics(
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, value)| {
                    let mut labels: Labels = key
                        .key()
                        .labels()
                        .map(|label| (label.key().to_owned(), label.value().to_owned()))
                        .collect();
                    labels.sort();
                    (key.key().name().to_owned(), labels, value)
                })
                .collect(),
        )
    }

    fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        let mut wanted: Labels = labels
            .iter()
            .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
            .collect();
        wanted.sort();
        self.0
            .iter()
            .find(|(found, labels, _)| found == name && *labels == wanted)
            .map(|(_, _, value)| value)
    }

    /// A counter's value; 0 when it was never incremented.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.find(name, labels) {
            Some(DebugValue::Counter(value)) => *value,
            Some(other) => panic!("{name} is not a counter: {other:?}"),
            None => 0,
        }
    }

    /// A histogram's samples, in seconds.
    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match self.find(name, labels) {
            Some(DebugValue::Histogram(values)) => values.iter().map(|value| value.0).collect(),
            Some(other) => panic!("{name} is not a histogram: {other:?}"),
            None => Vec::new(),
        }
    }

    /// Every metric name recorded, sorted, once each.
    fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.0.iter().map(|(name, _, _)| name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names
    }
}

struct Msg {
    id: String,
}

/// The same test on each backend: a message processed, then delivered again, then one
/// with an invalid id, then one whose body fails; the counts and the rows agree.
macro_rules! every_backend {
    (
        $backend:ident,
        $db:ty,
        $connection:ty,
        $pool:expr,
        $create:literal,
        $insert:literal,
        $count:literal,
        $claims:literal
    ) => {
        mod $backend {
            use super::*;

            #[idempotent(consumer = "metrics-test", key = msg.id)]
            async fn book(tx: &mut $connection, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query($insert).bind(&msg.id).execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "metrics-test", key = msg.id)]
            async fn refuse(tx: &mut $connection, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query($insert).bind(&msg.id).execute(&mut *tx).await?;
                Err(sqlx::Error::RowNotFound)
            }

            #[test]
            fn counts_describe_the_tables() {
                let id = dedup_suite::unique("metrics");
                let failing = dedup_suite::unique("metrics-failing");
                let metrics = recorded(async {
                    let holder = $pool;
                    let pool: &sqlx::Pool<$db> = &holder;
                    // One test at a time (and on PostgreSQL under an advisory lock): two
                    // concurrent `CREATE TABLE IF NOT EXISTS` race on the catalog.
                    dedup_suite::ddl(pool, $create).await;
                    let msg = Msg { id: id.clone() };
                    let first = book(pool, &msg).await.unwrap();
                    assert!(matches!(first, Outcome::Processed(())));
                    let again = book(pool, &msg).await.unwrap();
                    assert!(matches!(
                        again,
                        Outcome::Duplicate(Duplicate::AlreadyProcessed)
                    ));
                    let empty = Msg { id: String::new() };
                    let error = book(pool, &empty).await.unwrap_err();
                    assert!(InvalidMessageId::find(&error).is_some());
                    let error = refuse(
                        pool,
                        &Msg {
                            id: failing.clone(),
                        },
                    )
                    .await
                    .unwrap_err();
                    assert!(matches!(error, sqlx::Error::RowNotFound));

                    // What the tables hold: one effect and one dedup row, for `id` only.
                    for (message, rows) in [(&id, 1), (&failing, 0)] {
                        let effects: i64 = sqlx::query_scalar($count)
                            .bind(message)
                            .fetch_one(pool)
                            .await
                            .unwrap();
                        assert_eq!(effects, rows, "effects of {message}");
                        let claims: i64 = sqlx::query_scalar($claims)
                            .bind(message)
                            .fetch_one(pool)
                            .await
                            .unwrap();
                        assert_eq!(claims, rows, "dedup rows of {message}");
                    }
                });
                let book = [("handler", "book"), ("consumer", "metrics-test")];
                let refuse = [("handler", "refuse"), ("consumer", "metrics-test")];
                let with = |labels: &[(&'static str, &'static str)], more| {
                    let mut labels = labels.to_vec();
                    labels.push(more);
                    labels
                };
                assert_eq!(metrics.counter("dedup_processed_total", &book), 1);
                assert_eq!(
                    metrics.counter(
                        "dedup_duplicates_total",
                        &with(&book, ("rule", "message_id"))
                    ),
                    1
                );
                assert_eq!(
                    metrics.counter(
                        "dedup_failures_total",
                        &with(&book, ("class", "invalid_id"))
                    ),
                    1
                );
                assert_eq!(
                    metrics.counter("dedup_failures_total", &with(&refuse, ("class", "body"))),
                    1
                );
                assert_eq!(metrics.counter("dedup_processed_total", &refuse), 0);
                assert_eq!(metrics.counter("dedup_retries_total", &book), 0);
                let latency = "dedup_handler_duration_seconds";
                for (labels, calls) in [
                    (with(&book, ("outcome", "processed")), 1),
                    (with(&book, ("outcome", "duplicate")), 1),
                    (with(&book, ("outcome", "failed")), 1),
                    (with(&refuse, ("outcome", "failed")), 1),
                ] {
                    let samples = metrics.samples(latency, &labels);
                    assert_eq!(samples.len(), calls, "{labels:?}");
                    assert!(samples.iter().all(|seconds| (0.0..60.0).contains(seconds)));
                }
                assert_eq!(
                    metrics.names(),
                    [
                        "dedup_duplicates_total",
                        "dedup_failures_total",
                        "dedup_handler_duration_seconds",
                        "dedup_processed_total",
                    ]
                );
            }
        }
    };
}

every_backend!(
    sqlite,
    sqlx::Sqlite,
    sqlx::SqliteConnection,
    dedup_suite::sqlite().await,
    "CREATE TABLE IF NOT EXISTS metrics_effects (message_id TEXT PRIMARY KEY)",
    "INSERT INTO metrics_effects (message_id) VALUES (?)",
    "SELECT COUNT(*) FROM metrics_effects WHERE message_id = ?",
    "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'metrics-test' AND message_id = ?"
);
every_backend!(
    postgres,
    sqlx::Postgres,
    sqlx::PgConnection,
    dedup_suite::postgres().await,
    "CREATE TABLE IF NOT EXISTS metrics_effects (message_id text PRIMARY KEY)",
    "INSERT INTO metrics_effects (message_id) VALUES ($1)",
    "SELECT COUNT(*) FROM metrics_effects WHERE message_id = $1",
    "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'metrics-test' AND message_id = $1"
);
every_backend!(
    mysql,
    sqlx::MySql,
    sqlx::MySqlConnection,
    dedup_suite::mysql().await,
    "CREATE TABLE IF NOT EXISTS metrics_effects (message_id VARCHAR(255) PRIMARY KEY)",
    "INSERT INTO metrics_effects (message_id) VALUES (?)",
    "SELECT COUNT(*) FROM metrics_effects WHERE message_id = ?",
    "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'metrics-test' AND message_id = ?"
);

mod retries_and_business_keys {
    use super::*;

    static ATTEMPTS: AtomicU32 = AtomicU32::new(0);

    /// Fails its first attempt with a real serialization failure (SQLSTATE 40001, raised
    /// by the server), which the generated code retries.
    #[idempotent(consumer = "metrics-retry", key = msg.id)]
    async fn flaky(tx: &mut sqlx::PgConnection, msg: &Msg) -> Result<(), sqlx::Error> {
        if ATTEMPTS.fetch_add(1, Ordering::SeqCst) == 0 {
            sqlx::query(
                "DO $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = 'serialization_failure'; END $$",
            )
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query("INSERT INTO metrics_effects (message_id) VALUES ($1)")
            .bind(&msg.id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// Business-key dedup alone: no consumer, so the `consumer` label is empty.
    #[idempotent(unique = "metrics_orders_pkey")]
    async fn order(tx: &mut sqlx::PgConnection, msg: &Msg) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO metrics_orders (order_id) VALUES ($1)")
            .bind(&msg.id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    #[test]
    fn a_retry_and_a_business_key_duplicate_on_postgres() {
        let id = dedup_suite::unique("metrics-retry");
        let order_id = dedup_suite::unique("metrics-order");
        let metrics = recorded(async {
            let pool = dedup_suite::postgres().await;
            for ddl in [
                "CREATE TABLE IF NOT EXISTS metrics_effects (message_id text PRIMARY KEY)",
                "CREATE TABLE IF NOT EXISTS metrics_orders (order_id text \
                 CONSTRAINT metrics_orders_pkey PRIMARY KEY)",
            ] {
                dedup_suite::ddl(&pool, ddl).await;
            }
            let msg = Msg { id: id.clone() };
            assert!(matches!(
                flaky(&pool, &msg).await.unwrap(),
                Outcome::Processed(())
            ));
            assert_eq!(ATTEMPTS.load(Ordering::SeqCst), 2);
            let effects: i64 =
                sqlx::query_scalar("SELECT COUNT(*) FROM metrics_effects WHERE message_id = $1")
                    .bind(&id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(effects, 1);
            let claims: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'metrics-retry' \
                 AND message_id = $1",
            )
            .bind(&id)
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!(claims, 1);

            let ship = Msg {
                id: order_id.clone(),
            };
            assert!(matches!(
                order(&pool, &ship).await.unwrap(),
                Outcome::Processed(())
            ));
            let again = order(&pool, &ship).await.unwrap();
            assert!(matches!(
                again,
                Outcome::Duplicate(Duplicate::BusinessKey {
                    constraint: "metrics_orders_pkey"
                })
            ));
            let orders: i64 =
                sqlx::query_scalar("SELECT COUNT(*) FROM metrics_orders WHERE order_id = $1")
                    .bind(&order_id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(orders, 1);
        });
        let flaky = [("handler", "flaky"), ("consumer", "metrics-retry")];
        assert_eq!(metrics.counter("dedup_retries_total", &flaky), 1);
        assert_eq!(metrics.counter("dedup_processed_total", &flaky), 1);
        let latency = metrics.samples(
            "dedup_handler_duration_seconds",
            &[
                ("handler", "flaky"),
                ("consumer", "metrics-retry"),
                ("outcome", "processed"),
            ],
        );
        assert_eq!(latency.len(), 1, "one call, however many attempts");
        let order = [("handler", "order"), ("consumer", "")];
        assert_eq!(metrics.counter("dedup_processed_total", &order), 1);
        assert_eq!(
            metrics.counter(
                "dedup_duplicates_total",
                &[
                    ("handler", "order"),
                    ("consumer", ""),
                    ("rule", "business_key")
                ]
            ),
            1
        );
    }
}

/// Leased calls: a copy told "in progress", a mark-first outcome unknown, a completion
/// refused because the lease was lost, and one processed — each counted under its own
/// name or label, and each matching the row it left (SQLite).
mod leases {
    use super::*;
    use dedup_runtime::{Lease, LeaseLost, LeaseOutcome};

    #[idempotent(consumer = "metrics-lease", key = msg.id, effect = "send-first", lease = "30s")]
    async fn call(
        lease: &mut Lease<'_, sqlx::Sqlite>,
        msg: &Msg,
        steal: Option<&sqlx::SqlitePool>,
    ) -> Result<(), sqlx::Error> {
        if let Some(pool) = steal {
            // Another owner takes the lease over while the call runs.
            sqlx::query("UPDATE processed_messages SET owner = x'09' WHERE message_id = ?1")
                .bind(&msg.id)
                .execute(pool)
                .await?;
        }
        Ok(())
    }

    #[idempotent(consumer = "metrics-mark", key = msg.id, effect = "mark-first")]
    async fn ping(lease: &mut Lease<'_, sqlx::Sqlite>, msg: &Msg) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// Plants a row of another owner: `state`, and its lease ended (`expired`) or not.
    async fn plant(pool: &sqlx::SqlitePool, consumer: &str, id: &str, state: i64, expired: bool) {
        let expires = if expired { "-1 seconds" } else { "+60 seconds" };
        sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, state, owner, expires_at) \
             VALUES (?1, ?2, ?3, x'0102', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?4))",
        )
        .bind(consumer)
        .bind(id)
        .bind(state)
        .bind(expires)
        .execute(pool)
        .await
        .unwrap();
    }

    #[test]
    fn leased_outcomes_have_their_own_counts() {
        let metrics = recorded(async {
            let db = dedup_suite::sqlite().await;
            let pool: &sqlx::SqlitePool = &db;
            let busy = Msg { id: "busy".into() };
            plant(pool, "metrics-lease", "busy", 1, false).await;
            assert!(call(pool, &busy, None).await.unwrap().is_in_progress());

            let lost = Msg { id: "lost".into() };
            plant(pool, "metrics-mark", "lost", 2, true).await;
            assert_eq!(
                ping(pool, &lost).await.unwrap(),
                LeaseOutcome::Duplicate(Duplicate::OutcomeUnknown)
            );

            let fine = Msg { id: "fine".into() };
            assert_eq!(
                call(pool, &fine, None).await.unwrap(),
                LeaseOutcome::Processed(())
            );

            // A lease taken over mid-call: the owner token no longer matches at the end.
            let stolen = Msg {
                id: "stolen".into(),
            };
            let error = call(pool, &stolen, Some(pool)).await.unwrap_err();
            assert!(LeaseLost::find(&error).is_some(), "{error:?}");

            let states: Vec<(String, Option<i64>)> = sqlx::query_as(
                "SELECT message_id, state FROM processed_messages ORDER BY message_id",
            )
            .fetch_all(pool)
            .await
            .unwrap();
            let expected: Vec<(String, Option<i64>)> = vec![
                ("busy".into(), Some(1)),
                ("fine".into(), None),
                ("lost".into(), Some(2)),
                ("stolen".into(), Some(1)),
            ];
            assert_eq!(states, expected, "the rows the counts describe");
        });
        let lease = [("handler", "call"), ("consumer", "metrics-lease")];
        let mark = [("handler", "ping"), ("consumer", "metrics-mark")];
        assert_eq!(metrics.counter("dedup_in_progress_total", &lease), 1);
        assert_eq!(metrics.counter("dedup_processed_total", &lease), 1);
        let failed = [lease[0], lease[1], ("class", "lease_lost")];
        assert_eq!(metrics.counter("dedup_failures_total", &failed), 1);
        let unknown = [mark[0], mark[1], ("rule", "outcome_unknown")];
        assert_eq!(metrics.counter("dedup_duplicates_total", &unknown), 1);
        let in_progress = [lease[0], lease[1], ("outcome", "in_progress")];
        assert_eq!(
            metrics
                .samples("dedup_handler_duration_seconds", &in_progress)
                .len(),
            1
        );
    }
}

/// The inbox's counters and gauges (SQLite): receipts by outcome, workers' ends by
/// outcome, and the row counts of `stats`, each matching the rows.
mod inbox {
    use super::*;
    use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};

    struct Fails(&'static str);

    impl InboxHandler<sqlx::Sqlite> for Fails {
        type Error = String;
        async fn handle(
            &self,
            _: &mut sqlx::SqliteConnection,
            message: &InboxMessage,
        ) -> Result<(), String> {
            if message.id() == self.0 {
                Err("poison".into())
            } else {
                Ok(())
            }
        }
    }

    #[test]
    fn receipts_ends_and_rows_are_counted() {
        let metrics = recorded(async {
            let db = dedup_suite::sqlite().await;
            let pool: &sqlx::SqlitePool = &db;
            dedup_runtime::inbox::migrate(pool).await.unwrap();
            let inbox = Inbox::new(pool, "metrics-inbox").unwrap();
            inbox.receive(Incoming::new("a", b"1")).await.unwrap();
            inbox.receive(Incoming::new("a", b"1")).await.unwrap();
            inbox.receive(Incoming::new("", b"1")).await.unwrap_err();
            let answers = inbox
                .receive_batch(&[
                    Incoming::new("b", b"2"),
                    Incoming::new("c", b"3"),
                    Incoming::new("b", b"2"),
                ])
                .await
                .unwrap();
            assert_eq!(answers.len(), 3);
            let batch = inbox
                .worker()
                .max_attempts(1)
                .process_batch(&Fails("c"))
                .await
                .unwrap();
            assert_eq!((batch.processed, batch.dead), (2, 1));
            let stats = inbox.stats().await.unwrap();
            assert_eq!((stats.pending, stats.processed, stats.dead), (0, 2, 1));
            assert_eq!(inbox.backlog(10).await.unwrap(), 0);
        });
        let labels = |outcome| [("consumer", "metrics-inbox"), ("outcome", outcome)];
        assert_eq!(
            metrics.counter("dedup_inbox_received_total", &labels("stored")),
            3
        );
        assert_eq!(
            metrics.counter("dedup_inbox_received_total", &labels("duplicate")),
            2
        );
        assert_eq!(
            metrics.counter("dedup_inbox_received_total", &labels("refused")),
            1
        );
        assert_eq!(
            metrics.counter("dedup_inbox_processed_total", &labels("processed")),
            2
        );
        assert_eq!(
            metrics.counter("dedup_inbox_processed_total", &labels("dead")),
            1
        );
        let rows = |state| [("consumer", "metrics-inbox"), ("state", state)];
        assert!(
            matches!(metrics.find("dedup_inbox_rows", &rows("processed")), Some(DebugValue::Gauge(value)) if value.0 == 2.0)
        );
        assert!(
            matches!(metrics.find("dedup_inbox_rows", &rows("dead")), Some(DebugValue::Gauge(value)) if value.0 == 1.0)
        );
        assert!(
            matches!(metrics.find("dedup_inbox_rows", &rows("pending")), Some(DebugValue::Gauge(value)) if value.0 == 0.0)
        );
    }
}

/// A batch's size, its messages by outcome and its splits (SQLite), matching the rows.
mod batch {
    use super::*;
    use dedup_runtime::batch::{Batch, BatchHandler};

    /// Records nothing but fails on the id `poison`.
    struct Fails;

    impl BatchHandler<sqlx::Sqlite, Msg> for Fails {
        type Error = std::io::Error;

        async fn handle(
            &self,
            _: &mut sqlx::SqliteConnection,
            fresh: &[&Msg],
        ) -> Result<(), std::io::Error> {
            if fresh.iter().any(|msg| msg.id == "poison") {
                return Err(std::io::Error::other("poison"));
            }
            Ok(())
        }
    }

    #[test]
    fn sizes_outcomes_and_splits_are_counted() {
        let metrics = recorded(async {
            let db = dedup_suite::sqlite().await;
            let pool: &sqlx::SqlitePool = &db;
            dedup_runtime::migrate(pool).await.unwrap();
            let batch = Batch::new("metrics-batch").unwrap();
            let msgs = |ids: &[&str]| -> Vec<Msg> {
                ids.iter()
                    .map(|id| Msg {
                        id: (*id).to_owned(),
                    })
                    .collect()
            };
            batch
                .run(pool, &msgs(&["a"]), |m| m.id.as_str(), &Fails)
                .await
                .unwrap();
            let outcome = batch
                .run(
                    pool,
                    &msgs(&["a", "b", "poison", "b", "", "c"]),
                    |m| m.id.as_str(),
                    &Fails,
                )
                .await
                .unwrap();
            assert_eq!(
                (outcome.processed(), outcome.duplicates(), outcome.failed()),
                (2, 1, 1)
            );
            assert_eq!(dedup_suite::claims(pool, "metrics-batch", "b").await, 1);
            assert_eq!(
                dedup_suite::claims(pool, "metrics-batch", "poison").await,
                0
            );
        });
        let labels = |outcome| [("consumer", "metrics-batch"), ("outcome", outcome)];
        for (outcome, count) in [
            ("processed", 3),
            ("duplicate", 1),
            ("failed", 1),
            ("copy", 1),
            ("invalid", 1),
        ] {
            assert_eq!(
                metrics.counter("dedup_batch_messages_total", &labels(outcome)),
                count,
                "{outcome}"
            );
        }
        assert_eq!(
            metrics.samples("dedup_batch_size", &[("consumer", "metrics-batch")]),
            [1.0, 6.0]
        );
        // Fresh: b, poison, c. Split into [b] and [poison, c], then [poison] and [c].
        assert_eq!(
            metrics.counter("dedup_batch_splits_total", &[("consumer", "metrics-batch")]),
            2
        );
    }
}
