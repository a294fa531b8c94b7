//! Issue 39, item 5: once the three prune loops became one, `Prune::run`,
//! `Prune::run_inbox`, `Prune::run_outbox` and `Inbox::prune` returned futures that were
//! not `Send`. The shared loop took an `AsyncFnMut` that borrowed the run's pool and
//! table, and rustc cannot prove the futures of such a closure `Send` for every lifetime
//! of their argument: `tokio::spawn(async move { prune.run(&pool, |_| {}).await })`, the
//! way a service runs its pruning, failed to compile ("implementation of `Send` is not
//! general enough"). This fixture is that spawn, of each prune on each backend, on a
//! multi-threaded runtime; before the fix it did not compile.

use std::time::Duration;

use dedup_runtime::inbox::Inbox;
use dedup_runtime::outbox::Outbox;
use dedup_runtime::{Prune, PruneProgress};
use dedup_suite::{unique, unique_table};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// A week of ids kept, for a broker that redelivers for up to 4 days.
fn weekly() -> Prune {
    Prune::new(7 * DAY, 4 * DAY)
}

/// The run ended on its own, after one batch: nothing else to delete.
fn finished(done: &PruneProgress) {
    assert!(done.done, "{done:?}");
    assert_eq!(done.batches, 1, "{done:?}");
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr, insert_old = $insert_old:literal) => {
        mod $backend {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_prune_runs_in_a_task_of_its_own() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                dedup_runtime::inbox::migrate(&pool).await.unwrap();
                let consumer = unique("regress-spawn");
                // An id processed 10 days ago: the spawned run deletes it.
                sqlx::query($insert_old)
                    .bind(&consumer)
                    .execute(&pool)
                    .await
                    .unwrap();

                let (prune, owned) = (weekly().consumer(&consumer), pool.clone());
                let done = tokio::spawn(async move { prune.run(&owned, |_| {}).await })
                    .await
                    .unwrap()
                    .unwrap();
                finished(&done);
                assert_eq!(done.deleted, 1);

                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let owned = inbox.clone();
                let done = tokio::spawn(async move { weekly().run_inbox(&owned, |_| {}).await })
                    .await
                    .unwrap()
                    .unwrap();
                finished(&done);
                let deleted = tokio::spawn(async move { inbox.prune(7 * DAY, 4 * DAY).await })
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(deleted, 0);

                let table = unique_table("regress_spawn_outbox");
                dedup_runtime::outbox::migrate_table(&pool, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let done =
                    tokio::spawn(async move { weekly().run_outbox(&outbox, &pool, |_| {}).await })
                        .await
                        .unwrap()
                        .unwrap();
                finished(&done);
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    insert_old = "INSERT INTO processed_messages (consumer, message_id, processed_at) \
                  VALUES ($1, 'old', now() - interval '10 days')"
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    insert_old = "INSERT INTO processed_messages (consumer, message_id, processed_at) \
                  VALUES (?, 'old', UTC_TIMESTAMP(6) - INTERVAL 10 DAY)"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    insert_old = "INSERT INTO processed_messages (consumer, message_id, processed_at) \
                  VALUES (?, 'old', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-10 days'))"
);
