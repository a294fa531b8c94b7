//! A message whose handler killed its worker took the rows claimed with it to the dead
//! state: the next worker took the stopped worker's expired rows over all together, the
//! message in hand killed it again with all of them claimed, and each death counted an
//! attempt of every one — after the last, they were all buried "dead: the worker stopped",
//! messages that never ran. A claim took over one such row at a time, first in its batch,
//! so that the killer was alone when it killed again (each row claimed with it still lost
//! one attempt). Since issue 24, item 5, a stopped worker's claim is taken back in bulk:
//! the first unfinished row in the claim's order, the one in hand, keeps its attempt, and
//! the others, which never started, get theirs back — they lose nothing.
//!
//! The worker's death is its task aborted mid-handler (its transaction rolled back, its
//! claim left to expire); `tests/suite/inbox/workers.rs` kills a real process the same way.

use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use tokio::sync::Notify;

/// Never returns for the `kill` message (its worker is stopped there); an effect row for
/// every other.
struct Handler {
    entered: Arc<Notify>,
}

impl InboxHandler<sqlx::Sqlite> for Handler {
    type Error = sqlx::Error;

    async fn handle(
        &self,
        tx: &mut sqlx::SqliteConnection,
        message: &InboxMessage,
    ) -> Result<(), sqlx::Error> {
        if message.payload() == b"kill" {
            self.entered.notify_one();
            std::future::pending::<()>().await;
        }
        sqlx::query("INSERT INTO regress_killer_effects (message_id) VALUES (?1)")
            .bind(message.id())
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killer_costs_the_rows_claimed_with_it_nothing() {
    let db = dedup_suite::sqlite().await;
    let pool: sqlx::SqlitePool = (*db).clone();
    dedup_runtime::inbox::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE regress_killer_effects (message_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let inbox = Inbox::new(&pool, "regress-killer").unwrap();
    let answers = inbox
        .receive_batch(&[
            Incoming::new("killer", b"kill"),
            Incoming::new("a", b"p"),
            Incoming::new("b", b"p"),
        ])
        .await
        .unwrap();
    assert!(answers.iter().all(Result::is_ok));
    let expire = "UPDATE inbox_messages SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') WHERE state = 1";
    // Two workers die in the killer's handler: 2 attempts, its last.
    for _ in 0..2 {
        let entered = Arc::new(Notify::new());
        let task = tokio::spawn({
            let (pool, entered) = (pool.clone(), entered.clone());
            async move {
                let inbox = Inbox::new(&pool, "regress-killer").unwrap();
                let worker = inbox.worker().max_attempts(2).batch(3);
                worker.process_batch(&Handler { entered }).await
            }
        });
        tokio::time::timeout(Duration::from_secs(15), entered.notified())
            .await
            .expect("in the killer's handler");
        task.abort();
        let _ = task.await;
        sqlx::query(expire).execute(&pool).await.unwrap();
    }
    let worker = inbox.worker().max_attempts(2).batch(3);
    let handler = Handler {
        entered: Arc::new(Notify::new()),
    };
    while worker.process_batch(&handler).await.unwrap().claimed > 0 {}
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT message_id, state, attempts FROM inbox_messages WHERE consumer = 'regress-killer' ORDER BY message_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            ("a".to_owned(), 2, 1),
            ("b".to_owned(), 2, 1),
            ("killer".to_owned(), 3, 2),
        ],
        "the killer dead after its attempts, the others processed at their first attempt"
    );
    let effects: Vec<String> =
        sqlx::query_scalar("SELECT message_id FROM regress_killer_effects ORDER BY message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(effects, ["a", "b"]);
}
