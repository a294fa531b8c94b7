//! Operating the inbox: retention on every backend (pruning keeps the broker's redelivery
//! window and never touches unfinished rows); on PostgreSQL, the claim queries through
//! their partial indexes as the inbox grows; the operator's command (`dedup inbox`)
//! against a SQLite file.

use std::time::Duration;

use dedup_runtime::inbox::{Inbox, Incoming};
use dedup_suite::unique;

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

/// The operator's command (`dedup inbox`, run in process) against a SQLite file: `stats`,
/// `dead` with the last error, `requeue` and `discard` of dead rows by id (a pending one
/// named is left alone), and exit status 2 when no row is named.
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
    let url = format!("sqlite:{}", db.path().display());
    let (code, out, err) = dedup(&["inbox", "stats", "--database-url", &url]).await;
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .find(|line| line.trim_start().starts_with("ops"))
        .unwrap();
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        &cells[..5],
        ["ops", "1", "0", "0", "2"],
        "pending, in flight, processed, dead: {out}"
    );
    let (code, out, _) =
        dedup(&["inbox", "dead", "--database-url", &url, "--consumer", "ops"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("2 dead rows matching"), "{out}");
    assert!(
        out.contains("evt_dead_1  consumer ops")
            && out.contains("after 5 attempts: cannot parse: missing field `cents`"),
        "{out}"
    );
    let (code, out, _) = dedup(&[
        "inbox",
        "requeue",
        "--database-url",
        &url,
        "--consumer",
        "ops",
        "--id",
        "evt_dead_1",
        "--id",
        "evt_pending",
    ])
    .await;
    assert_eq!(code, 0);
    assert!(
        out.contains("1 of 1 matching dead rows re-queued"),
        "the pending one is not dead: {out}"
    );
    let (code, out, _) = dedup(&[
        "inbox",
        "discard",
        "--database-url",
        &url,
        "--consumer",
        "ops",
        "--id",
        "evt_dead_2",
    ])
    .await;
    assert_eq!(code, 0);
    assert!(out.contains("1 of 1 matching dead rows discarded"), "{out}");
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
    let (code, _, err) = dedup(&["inbox", "requeue", "--database-url", &url]).await;
    assert_eq!(code, 2, "no row named: a usage error");
    assert!(err.contains("no rows named"), "{err}");
}

/// Runs `dedup` in process: exit status, stdout, stderr.
pub(crate) async fn dedup(args: &[&str]) -> (u8, String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let argv = std::iter::once("dedup").chain(args.iter().copied());
    let code = dedup_cli::run(argv, &mut out, &mut err).await;
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}
