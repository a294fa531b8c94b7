//! Issue 8, defect 3 — MariaDB/MySQL: a swallowed deadlock doubled the effect.
//!
//! InnoDB rolls the whole transaction back on a deadlock (1213) and the session returns
//! to autocommit. A body that caught the error and went on wrote the rest of its effect in
//! autocommit, the final `COMMIT` was a no-op, and the handler returned `Processed` with
//! no dedup row: the redelivery applied the effect again. The handler's transaction now
//! keeps the session out of autocommit, and its `COMMIT` goes out only while the
//! transaction that claimed is still there (the savepoint it began with is released
//! first, in the same round trip).

use dedup_runtime::{Outcome, idempotent};
use dedup_suite::Runs;
use sqlx::mysql::MySqlPool;
use sqlx::{AssertSqlSafe, MySqlConnection};
use tokio::sync::Barrier;

async fn pool() -> MySqlPool {
    let pool = dedup_suite::mysql().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS regress_deadlock_effects \
         (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB; \
         CREATE TABLE IF NOT EXISTS regress_deadlock_locks \
         (name VARBINARY(255) PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB",
    )
    .await;
    pool
}

/// Effect, then the two rows in the given order (the first run waits for the other task
/// in between, so that the two deadlock), then more effect. A failed update is swallowed.
#[idempotent(consumer = "regress-my-deadlock", key = id)]
async fn swallow_deadlock(
    tx: &mut MySqlConnection,
    id: &str,
    first: &str,
    second: &str,
    barrier: &Barrier,
    runs: &Runs,
) -> Result<(), sqlx::Error> {
    let run = runs.next();
    sqlx::query("INSERT INTO regress_deadlock_effects (message_id) VALUES (?)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    swallow_updates(tx, "regress_deadlock_locks", [first, second], barrier, run).await;
    sqlx::query("INSERT INTO regress_deadlock_effects (message_id) VALUES (?)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// The mistake under test: the two lock rows of `table` updated in the given order — on
/// its first run the call waits for the other task in between, so that the two deadlock
/// — with each failed update's error dropped.
pub(crate) async fn swallow_updates(
    tx: &mut MySqlConnection,
    table: &str,
    names: [&str; 2],
    barrier: &Barrier,
    run: u32,
) {
    for (step, name) in names.into_iter().enumerate() {
        if step == 1 && run == 1 {
            barrier.wait().await;
        }
        let _ = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {table} SET n = n + 1 WHERE name = ?"
        )))
        .bind(name)
        .execute(&mut *tx)
        .await;
    }
}

/// (effect rows, dedup rows) of message `id`.
async fn counts(pool: &MySqlPool, id: &str) -> (i64, i64) {
    (
        dedup_suite::rows(pool, "regress_deadlock_effects", "message_id", id).await,
        dedup_suite::claims(pool, "regress-my-deadlock", id).await,
    )
}

/// Two lock rows in `table` (`name`, `n`), named after `tag`.
pub(crate) async fn lock_rows(pool: &MySqlPool, table: &str, tag: &str) -> (String, String) {
    let (a, b) = (
        dedup_suite::unique(&format!("{tag}-a")),
        dedup_suite::unique(&format!("{tag}-b")),
    );
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (name, n) VALUES (?, 0), (?, 0)"
    )))
    .bind(&a)
    .bind(&b)
    .execute(pool)
    .await
    .unwrap();
    (a, b)
}

/// Runs the two calls together — each takes the lock rows in the other's order, so one is
/// the deadlock's victim — and checks that both end `Processed`, the victim's after
/// running its body again (`runs`: the two calls' counters).
pub(crate) async fn both_processed<E: std::fmt::Debug>(
    first: impl Future<Output = Result<Outcome<()>, E>>,
    second: impl Future<Output = Result<Outcome<()>, E>>,
    runs: [&Runs; 2],
) {
    let (first, second) = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        tokio::join!(first, second)
    })
    .await
    .expect("the deadlock is broken");
    assert_eq!(first.unwrap(), Outcome::Processed(()));
    assert_eq!(second.unwrap(), Outcome::Processed(()));
    let mut runs = runs.map(Runs::get);
    runs.sort_unstable();
    assert_eq!(
        runs,
        [1, 2],
        "the victim's transaction is not committed: run again"
    );
}

#[tokio::test]
async fn a_swallowed_deadlock_commits_all_or_nothing() {
    let pool = pool().await;
    let (a, b) = lock_rows(&pool, "regress_deadlock_locks", "dl").await;
    let (id_1, id_2) = (dedup_suite::unique("dl-1"), dedup_suite::unique("dl-2"));
    let barrier = Barrier::new(2);
    let (runs_1, runs_2) = (Runs::new(), Runs::new());
    both_processed(
        swallow_deadlock(&pool, &id_1, &a, &b, &barrier, &runs_1),
        swallow_deadlock(&pool, &id_2, &b, &a, &barrier, &runs_2),
        [&runs_1, &runs_2],
    )
    .await;
    // Each message: its dedup row and its whole effect (two rows), once.
    assert_eq!(counts(&pool, &id_1).await, (2, 1));
    assert_eq!(counts(&pool, &id_2).await, (2, 1));

    // Redeliveries change nothing.
    for (id, first, second) in [(&id_1, &a, &b), (&id_2, &b, &a)] {
        let outcome = swallow_deadlock(
            &pool,
            id,
            first,
            second,
            &Barrier::new(1),
            &Runs::starting_at(9),
        )
        .await
        .unwrap();
        assert!(outcome.is_duplicate());
        assert_eq!(counts(&pool, id).await, (2, 1));
    }

    // Every pooled connection is back in autocommit mode.
    let mut conns = Vec::new();
    for _ in 0..4 {
        let mut conn = pool.acquire().await.unwrap();
        let autocommit: i64 = sqlx::query_scalar("SELECT @@autocommit")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(autocommit, 1);
        conns.push(conn);
    }
}

/// The same on connections the caller lends, outside any transaction: the handler's own
/// transaction, its claim in a statement of its own, the same checked commit.
#[tokio::test]
async fn on_lent_connections_a_swallowed_deadlock_commits_all_or_nothing() {
    let pool = pool().await;
    let (a, b) = lock_rows(&pool, "regress_deadlock_locks", "dl-lent").await;
    let (id_1, id_2) = (
        dedup_suite::unique("dl-lent-1"),
        dedup_suite::unique("dl-lent-2"),
    );
    let (mut conn_1, mut conn_2) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    let barrier = Barrier::new(2);
    let (runs_1, runs_2) = (Runs::new(), Runs::new());
    both_processed(
        swallow_deadlock(&mut *conn_1, &id_1, &a, &b, &barrier, &runs_1),
        swallow_deadlock(&mut *conn_2, &id_2, &b, &a, &barrier, &runs_2),
        [&runs_1, &runs_2],
    )
    .await;
    assert_eq!(counts(&pool, &id_1).await, (2, 1));
    assert_eq!(counts(&pool, &id_2).await, (2, 1));
    // Both sessions are back in autocommit, outside any transaction.
    for conn in [&mut conn_1, &mut conn_2] {
        let (autocommit, open): (i64, i64) =
            sqlx::query_as("SELECT @@autocommit, CAST(@@in_transaction AS SIGNED)")
                .fetch_one(&mut **conn)
                .await
                .unwrap();
        assert_eq!((autocommit, open), (1, 0));
    }
}
