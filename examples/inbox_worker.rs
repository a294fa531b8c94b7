//! The worker process of the inbox's process-killing test (`tests/suite/inbox/workers.rs`): it works
//! through an inbox until nothing is pending or claimed, with a handler that writes one
//! effect row per message — and, for a message whose payload is `kill`, writes its effect
//! and then kills its own process with SIGKILL, inside the handler's transaction: a handler
//! that kills its process every time (`panic = "abort"`, an out-of-memory kill, a native
//! crash). The test starts it again after each death; the attempt counted at the claim
//! makes that message dead after its attempts, and the others complete.
//!
//! Environment: `DATABASE_URL` (`postgres://…`, `mysql://…` or `sqlite:…`),
//! `DEDUP_INBOX_CONSUMER`, and `DEDUP_INBOX_BATCHED` (set: batch mode,
//! `Worker::process_batched`, the claim's messages in one transaction). The effect table is `inbox_test_effects (message_id)`; the
//! worker's lease is 300 ms (a 50 ms heartbeat), its attempts 3, its poll 50 ms. It prints
//! `done` and exits 0 once the inbox has nothing left to do.

use std::time::Duration;

use dedup_runtime::batch::BatchHandler;
use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// One effect row per run, on the handler's transaction; SIGKILL of its own process for a
/// `kill` payload, after the effect (which the database then rolls back).
struct Effects {
    insert: &'static str,
}

macro_rules! effects {
    ($db:ty, $conn:ty) => {
        impl InboxHandler<$db> for Effects {
            type Error = sqlx::Error;

            async fn handle(
                &self,
                tx: &mut $conn,
                message: &InboxMessage,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(self.insert)
                    .bind(message.id())
                    .execute(&mut *tx)
                    .await?;
                if message.payload() == b"kill" {
                    kill_this_process();
                }
                Ok(())
            }
        }

        impl BatchHandler<$db, InboxMessage> for Effects {
            type Error = sqlx::Error;

            async fn handle(
                &self,
                tx: &mut $conn,
                messages: &[&InboxMessage],
            ) -> Result<(), sqlx::Error> {
                for message in messages {
                    InboxHandler::<$db>::handle(self, &mut *tx, message).await?;
                }
                Ok(())
            }
        }
    };
}

effects!(sqlx::Postgres, sqlx::PgConnection);
effects!(sqlx::MySql, sqlx::MySqlConnection);
effects!(sqlx::Sqlite, sqlx::SqliteConnection);

fn kill_this_process() -> ! {
    println!("killing myself");
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &std::process::id().to_string()])
        .status();
    std::process::abort()
}

async fn work<DB: dedup_runtime::Backend>(
    pool: &sqlx::Pool<DB>,
    consumer: &str,
    handler: &Effects,
) -> Result<(), Error>
where
    Effects: InboxHandler<DB> + BatchHandler<DB, InboxMessage>,
{
    let batched = std::env::var_os("DEDUP_INBOX_BATCHED").is_some();
    let inbox = Inbox::new(pool, consumer)?;
    let worker = inbox
        .worker()
        .lease(Duration::from_millis(300))
        .heartbeat(Duration::from_millis(50))
        .max_attempts(3);
    loop {
        let batch = if batched {
            worker.process_batched(handler).await?
        } else {
            worker.process_batch(handler).await?
        };
        if batch.claimed > 0 {
            continue;
        }
        let stats = inbox.stats().await?;
        if stats.pending == 0 && stats.claimed == 0 {
            println!("done");
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = std::env::var("DATABASE_URL")?;
    let consumer = std::env::var("DEDUP_INBOX_CONSUMER")?;
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(&url).await?;
        let insert = "INSERT INTO inbox_test_effects (message_id) VALUES ($1)";
        work(&pool, &consumer, &Effects { insert }).await
    } else if url.starts_with("mysql") || url.starts_with("mariadb") {
        let pool = sqlx::MySqlPool::connect(&url).await?;
        let insert = "INSERT INTO inbox_test_effects (message_id) VALUES (?)";
        work(&pool, &consumer, &Effects { insert }).await
    } else {
        let pool = sqlx::SqlitePool::connect(&url).await?;
        let insert = "INSERT INTO inbox_test_effects (message_id) VALUES (?1)";
        work(&pool, &consumer, &Effects { insert }).await
    }
}
