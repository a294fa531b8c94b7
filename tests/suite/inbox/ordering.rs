//! Ordering keys, on every backend: 4 workers over 4 keys × 40 messages run each key's
//! messages one at a time, in receive order; a failing head holds up its own key only; an
//! empty key is refused.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxError, InboxHandler, InboxMessage, Incoming, Refused};
use dedup_suite::unique;
use tokio::time::timeout;

use super::*;

macro_rules! ordering_suite {
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

            /// An ordering key: 4 workers, 4 keys × 40 messages received interleaved — each
            /// key's messages run one at a time, in receive order; a failing head holds up
            /// its own key only.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_ordering_key_runs_its_messages_one_at_a_time_in_order() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-ordered");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let keys = ["k0", "k1", "k2", "k3"];
                let ids: Vec<(String, &str)> = (0..160)
                    .map(|n| (format!("{consumer}/{n}"), keys[n % 4]))
                    .collect();
                let batch: Vec<Incoming<'_>> = ids
                    .iter()
                    .map(|(id, key)| Incoming::new(id.as_str(), b"p").ordering_key(key))
                    .collect();
                for chunk in batch.chunks(16) {
                    inbox.receive_batch(chunk).await.unwrap();
                }
                let runs = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
                /// Records each run, and fails the test if two of one key ever overlap.
                struct Recorder(
                    Arc<std::sync::Mutex<Vec<String>>>,
                    Arc<std::sync::Mutex<HashMap<String, u32>>>,
                );
                impl InboxHandler<$db> for Recorder {
                    type Error = String;
                    async fn handle(
                        &self,
                        tx: &mut $conn,
                        message: &InboxMessage,
                    ) -> Result<(), String> {
                        let key = message
                            .ordering_key()
                            .expect("received with a key")
                            .to_owned();
                        {
                            let mut running = self.1.lock().unwrap();
                            let count = running.entry(key.clone()).or_default();
                            *count += 1;
                            assert_eq!(*count, 1, "two messages of {key} at once");
                        }
                        self.0.lock().unwrap().push(message.id().to_owned());
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        let effect = sqlx::query($effect)
                            .bind(message.id())
                            .execute(&mut *tx)
                            .await;
                        *self.1.lock().unwrap().get_mut(&key).unwrap() -= 1;
                        effect.map(drop).map_err(|e| e.to_string())
                    }
                }
                let in_flight = Arc::new(std::sync::Mutex::new(HashMap::new()));
                let workers: Vec<_> = (0..4)
                    .map(|_| {
                        let (pool, consumer) = (pool.clone(), consumer.clone());
                        let handler = Recorder(runs.clone(), in_flight.clone());
                        tokio::spawn(async move {
                            let inbox = Inbox::new(&pool, &consumer).unwrap();
                            // (A failed attempt, a deadlock say, comes back at once.)
                            let worker = inbox
                                .worker()
                                .batch(4)
                                .backoff(Duration::from_millis(1), Duration::from_millis(5));
                            timeout(PATIENCE, async {
                                loop {
                                    let batch = worker.process_batch(&handler).await.unwrap();
                                    if batch.claimed == 0 {
                                        let stats = inbox.stats().await.unwrap();
                                        if stats.pending == 0 && stats.claimed == 0 {
                                            return;
                                        }
                                    }
                                    tokio::time::sleep(Duration::from_millis(2)).await;
                                }
                            })
                            .await
                            .expect("all processed");
                        })
                    })
                    .collect();
                for worker in workers {
                    worker.await.unwrap();
                }
                // A transaction the database ended (a deadlock) runs again, its first run
                // rolled back, before the next of its key can be claimed: the order is
                // that of each message's first run.
                let all_runs = runs.lock().unwrap().clone();
                let mut runs: Vec<String> = Vec::new();
                for id in all_runs {
                    if !runs.contains(&id) {
                        runs.push(id);
                    }
                }
                assert_eq!(runs.len(), 160, "each run");
                for key in keys {
                    let expected: Vec<&String> = ids
                        .iter()
                        .filter(|(_, k)| *k == key)
                        .map(|(id, _)| id)
                        .collect();
                    let seen: Vec<&String> =
                        runs.iter().filter(|id| expected.contains(id)).collect();
                    assert_eq!(seen, expected, "{key}: in receive order");
                }
                assert_eq!(effects(&pool, &consumer).await.len(), 160);

                // A failing head holds up its key only.
                let consumer = unique("inbox-ordered-head");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids: Vec<String> = (0..4).map(|n| format!("{consumer}/{n}")).collect();
                let keyed = [("a", 0), ("a", 1), ("b", 2), ("b", 3)];
                for (key, n) in keyed {
                    inbox
                        .receive(Incoming::new(ids[n].as_str(), b"p").ordering_key(key))
                        .await
                        .unwrap();
                }
                let handler = Effects::default();
                *handler.poison.lock().unwrap() = Some(ids[0].clone());
                let worker = inbox
                    .worker()
                    .backoff(Duration::from_secs(60), Duration::from_secs(60));
                for _ in 0..3 {
                    worker.process_batch(&handler).await.unwrap();
                }
                let done = effects(&pool, &consumer).await;
                assert_eq!(done.len(), 2, "b's two, not a's second: {done:?}");
                assert!(done.contains_key(&ids[2]) && done.contains_key(&ids[3]));
                assert_eq!(
                    state(&pool, &consumer, &ids[1]).await.0,
                    0,
                    "a's second waits"
                );
                let refused = inbox
                    .receive(Incoming::new("x", b"p").ordering_key(""))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(refused, InboxError::Refused(Refused::InvalidOrderingKey(_))),
                    "{refused:?}"
                );
            }
        }
    };
}

inbox_backends!(ordering_suite);
