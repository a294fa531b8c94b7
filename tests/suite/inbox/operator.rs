//! Operating the inbox: retention on every backend (pruning keeps the broker's redelivery
//! window and never touches unfinished rows); on PostgreSQL, the claim queries through
//! their partial indexes as the inbox grows; the operator's command (`examples/inbox.rs`)
//! against a SQLite file.

use std::time::Duration;

use dedup_runtime::inbox::{Inbox, Incoming};
use dedup_suite::unique;

use super::*;

macro_rules! operator_suite {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        pool = $pool:expr,
        row = $row:literal,
        count = $count:literal,
        effects = $effects:literal,
        effect = $effect:literal,
        group = $group:literal,
        state = $state:literal,
        expire = $expire:literal,
        age = $age:literal,
        url = |$db_ident:ident| $url:expr,
        $(takeover_mid_handler = $takeover:literal,)?
    ) => {
        mod $backend {
            use super::*;
            use crate::inbox::common::$backend::*;

            /// Retention: processed rows older than the age go, in batches; pending and
            /// dead rows and younger processed ones stay; an age shorter than the broker's
            /// redelivery window is refused before anything is deleted. With
            /// `drop_payloads`, the mark drops the payload at once.
            #[tokio::test]
            async fn pruning_keeps_the_redelivery_window_and_never_touches_unfinished_rows() {
                const DAY: Duration = Duration::from_secs(24 * 60 * 60);
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let consumer = unique("inbox-prune");
                let inbox = Inbox::new(pool, &consumer).unwrap().drop_payloads(true);
                let ids = receive_all(&inbox, 6).await;
                let handler = Effects::default();
                *handler.poison.lock().unwrap() = Some(ids[5].clone());
                let worker = inbox.worker().batch(4).max_attempts(1);
                worker.process_batch(&handler).await.unwrap(); // 0..=3 processed
                let (payload, headers, row_state, _) = row(pool, &consumer, &ids[0]).await.unwrap();
                assert_eq!(
                    (payload, headers, row_state),
                    (None, None, 2),
                    "payload dropped with the mark"
                );
                for id in &ids[..2] {
                    sqlx::query($age)
                        .bind(&consumer)
                        .bind(id)
                        .execute(pool)
                        .await
                        .unwrap();
                }
                let refused = inbox.prune(DAY, 2 * DAY).await;
                assert!(
                    matches!(
                        refused,
                        Err(dedup_runtime::PruneError::WindowTooShort { .. })
                    ),
                    "{refused:?}"
                );
                assert_eq!(rows(pool, &consumer).await, 6, "nothing deleted");
                worker.process_batch(&handler).await.unwrap(); // 4 processed, 5 dead
                let mut seen = Vec::new();
                let done = dedup_runtime::Prune::new(7 * DAY, 2 * DAY)
                    .batch_size(1)
                    .pause(Duration::ZERO)
                    .run_inbox(&inbox, |progress| seen.push(progress.deleted))
                    .await
                    .unwrap();
                assert_eq!((done.deleted, done.batches), (2, 3));
                assert_eq!(
                    seen,
                    [1, 2, 2],
                    "one row per batch, then the batch that found none"
                );
                assert_eq!(rows(pool, &consumer).await, 4);
                assert!(row(pool, &consumer, &ids[0]).await.is_none());
                let stats = inbox.stats().await.unwrap();
                assert_eq!((stats.processed, stats.dead), (3, 1));
                assert_eq!(inbox.prune(7 * DAY, 2 * DAY).await.unwrap(), 0);
            }
        }
    };
}

inbox_backends!(operator_suite);

/// No full scans as the inbox grows (PostgreSQL's plans, read with `EXPLAIN`): with
/// 20,000 processed rows and a few pending ones, the claim of pending rows, the takeover
/// of expired claims and the dead-row listing each go through their partial index.
#[tokio::test]
async fn postgres_claims_use_the_partial_indexes() {
    let pool = dedup_suite::postgres().await;
    dedup_runtime::inbox::migrate(&pool).await.unwrap();
    let consumer = unique("inbox-explain");
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_id, payload, state, processed_at) \
         SELECT $1, 'done-' || g, 'p', 2, clock_timestamp() FROM generate_series(1, 20000) AS g",
    )
    .bind(&consumer)
    .execute(&pool)
    .await
    .unwrap();
    let inbox = Inbox::new(&pool, &consumer).unwrap();
    for n in 0..5 {
        inbox
            .receive(Incoming::new(&format!("new-{n}"), b"p"))
            .await
            .unwrap();
    }
    sqlx::query("ANALYZE inbox_messages")
        .execute(&pool)
        .await
        .unwrap();
    for (query, index) in [
        (
            "SELECT consumer, message_id FROM inbox_messages AS m WHERE consumer = $1 \
             AND state = 0 AND next_attempt_at <= clock_timestamp() \
             AND (m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM inbox_messages AS e \
             WHERE e.consumer = m.consumer AND e.ordering_key = m.ordering_key \
             AND e.seq < m.seq AND e.state <> 2)) \
             ORDER BY next_attempt_at, seq LIMIT 16 FOR UPDATE SKIP LOCKED",
            "inbox_messages_pending_idx",
        ),
        (
            "SELECT consumer, message_id FROM inbox_messages WHERE consumer = $1 AND state = 1 \
             AND lease_until <= clock_timestamp() AND attempts < 5 ORDER BY lease_until, seq LIMIT 1 \
             FOR UPDATE SKIP LOCKED",
            "inbox_messages_claimed_idx",
        ),
        (
            "SELECT message_id FROM inbox_messages WHERE consumer = $1 AND state = 3 ORDER BY seq \
             LIMIT 100",
            "inbox_messages_dead_idx",
        ),
    ] {
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
            .bind(&consumer)
            .fetch_all(&pool)
            .await
            .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains(index), "{query}\n{plan}");
        assert!(!plan.contains("Seq Scan"), "{query}\n{plan}");
    }
    sqlx::query("DELETE FROM inbox_messages WHERE consumer = $1")
        .bind(&consumer)
        .execute(&pool)
        .await
        .unwrap();
}

/// `examples/inbox.rs`, the operator's command, run as a process against a SQLite file:
/// `stats`, `dead` with the last error, `requeue` and `discard` of dead rows only, and
/// exit status 2 for bad arguments.
#[tokio::test]
async fn the_operator_command_lists_requeues_and_discards_dead_messages() {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::inbox::migrate(&*db).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO inbox_messages (consumer, message_id, payload, state, attempts, last_error) \
         VALUES ('ops', 'evt_dead_1', x'00', 3, 5, 'cannot parse: missing field `cents`'), \
                ('ops', 'evt_dead_2', x'00', 3, 5, 'boom'), \
                ('ops', 'evt_pending', x'00', 0, 0, NULL)",
    )
    .execute(&*db)
    .await
    .unwrap();
    let program = examples("inbox").await;
    let url = format!("sqlite:{}", db.path().display());
    let run = |args: &[&str]| {
        let output = std::process::Command::new(&program)
            .args(args)
            .args(["--database-url", &url, "--consumer", "ops"])
            .env_remove("DATABASE_URL")
            .output()
            .expect("run the inbox command");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&["stats"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("pending             1") && out.contains("dead                2"),
        "{out}"
    );
    let (code, out, _) = run(&["dead"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("evt_dead_1  after 5 attempt(s): cannot parse: missing field `cents`"),
        "{out}"
    );
    let (code, out, _) = run(&["requeue", "evt_dead_1", "evt_pending"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("evt_dead_1  re-queued") && out.contains("evt_pending  not dead"),
        "{out}"
    );
    let (code, out, _) = run(&["discard", "evt_dead_2"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("evt_dead_2  discarded"), "{out}");
    let states: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT message_id, state, attempts FROM inbox_messages WHERE consumer = 'ops' ORDER BY message_id",
    )
    .fetch_all(&*db)
    .await
    .unwrap();
    assert_eq!(
        states,
        vec![
            ("evt_dead_1".to_owned(), 0, 0),
            ("evt_dead_2".to_owned(), 2, 5),
            ("evt_pending".to_owned(), 0, 0),
        ]
    );
    let (code, _, err) = run(&["requeue"]);
    assert_eq!(code, Some(2), "no id: a usage error");
    assert!(err.contains("no message id given"), "{err}");
    let (code, _, err) = run(&["requeue", ""]);
    assert_eq!(code, Some(2), "an invalid id: {err}");
}
