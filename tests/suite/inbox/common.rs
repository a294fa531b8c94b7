//! What the inbox's suites share on each backend: the handler most of them run
//! (`Effects`), and the helpers that set a database up, read its rows back, receive
//! messages and start a held worker. `inbox_backends!(common_helpers)` makes a module of
//! them per backend, `common::<backend>`, which that backend's module of each suite
//! imports.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use dedup_runtime::inbox::{
    BatchReport, Inbox, InboxError, InboxHandler, InboxMessage, Incoming, Received, Worker,
};

use super::*;

/// What a row holds: payload, headers, state, attempts.
type Stored = (Option<Vec<u8>>, Option<Vec<u8>>, i64, i64);

macro_rules! common_helpers {
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
        pub(crate) mod $backend {
            use super::*;

            /// The handler: one effect row per run; fails while `poison` names the message;
            /// stops at `hold` (if any) before its effect.
            #[derive(Default)]
            pub(crate) struct Effects {
                pub(crate) poison: std::sync::Mutex<Option<String>>,
                pub(crate) hold: Option<Arc<Hold>>,
                pub(crate) runs: AtomicU32,
            }

            impl InboxHandler<$db> for Effects {
                type Error = String;

                async fn handle(
                    &self,
                    tx: &mut $conn,
                    message: &InboxMessage,
                ) -> Result<(), String> {
                    self.runs.fetch_add(1, Ordering::SeqCst);
                    if let Some(hold) = &self.hold {
                        hold.here().await;
                    }
                    sqlx::query($effect)
                        .bind(message.id())
                        .execute(&mut *tx)
                        .await
                        .map_err(|error| error.to_string())?;
                    let poisoned = self.poison.lock().unwrap().as_deref() == Some(message.id());
                    if poisoned {
                        return Err(format!("cannot process {}: poison", message.id()));
                    }
                    Ok(())
                }
            }

            pub(crate) async fn setup(pool: &sqlx::Pool<$db>) {
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                dedup_suite::ddl(pool, $effects).await;
            }

            /// Effect rows per message id of `consumer` (ids are `<consumer>/<n>`).
            pub(crate) async fn effects(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
            ) -> HashMap<String, i64> {
                sqlx::query_as($group)
                    .bind(format!("{consumer}/%"))
                    .fetch_all(pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect()
            }

            /// A row's state, attempts and last error.
            pub(crate) async fn state(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
                id: &str,
            ) -> (i64, i64, Option<String>) {
                sqlx::query_as($state)
                    .bind(consumer)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            pub(crate) async fn receive_all(inbox: &Inbox<$db>, count: usize) -> Vec<String> {
                let ids: Vec<String> = (0..count)
                    .map(|n| format!("{}/{n}", inbox.consumer()))
                    .collect();
                let batch: Vec<Incoming<'_>> = ids
                    .iter()
                    .map(|id| Incoming::new(id.as_str(), b"p"))
                    .collect();
                for answer in inbox.receive_batch(&batch).await.unwrap() {
                    assert_eq!(answer, Ok(Received::Stored));
                }
                ids
            }

            /// A worker's `process_batch` in a task of its own, `configure`d, its handler
            /// stopping at `hold` before each effect.
            pub(crate) fn held_worker(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
                hold: &Arc<Hold>,
                configure: fn(Worker<$db>) -> Worker<$db>,
            ) -> tokio::task::JoinHandle<Result<BatchReport, InboxError>> {
                let (pool, consumer, hold) = (pool.clone(), consumer.to_owned(), hold.clone());
                tokio::spawn(async move {
                    let inbox = Inbox::new(&pool, &consumer).unwrap();
                    let handler = Effects {
                        hold: Some(hold),
                        ..Effects::default()
                    };
                    configure(inbox.worker()).process_batch(&handler).await
                })
            }

            pub(crate) async fn row(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
                id: &str,
            ) -> Option<Stored> {
                sqlx::query_as($row)
                    .bind(consumer)
                    .bind(id)
                    .fetch_optional(pool)
                    .await
                    .unwrap()
            }

            pub(crate) async fn rows(pool: &sqlx::Pool<$db>, consumer: &str) -> i64 {
                sqlx::query_scalar($count)
                    .bind(consumer)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }
        }
    };
}

inbox_backends!(common_helpers);
