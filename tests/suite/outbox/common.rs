//! What the outbox's relay suites share on each backend: an outbox of a test's own, rows
//! enqueued into it, a row's state read back, and every claim ended.
//! `outbox_backends!(common_helpers)` makes a module of them per backend,
//! `common::<backend>`, which that backend's module of each suite imports.

use dedup_runtime::outbox::{Cause, Outbox, OutgoingId};
use dedup_suite::unique_table;

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
        effect_count = $effect_count:literal,
        begin_writing = $begin_writing:literal,
        state = $state:literal,
        expire = $expire:literal,
        $(late_commits = $late:literal,)?
    ) => {
        pub(crate) mod $backend {
            use super::*;

            /// An outbox of its own for a relay test (relays take every row of their
            /// table), migrated.
            pub(crate) async fn own_outbox(pool: &sqlx::Pool<$db>) -> Outbox {
                let table = unique_table("outbox");
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                Outbox::new().in_table(&table).unwrap()
            }

            /// Enqueues one message per payload, slots 0, 1, …, in one transaction.
            pub(crate) async fn enqueue_all(
                pool: &sqlx::Pool<$db>,
                outbox: &Outbox,
                cause: &Cause,
                payloads: &[&[u8]],
            ) -> Vec<OutgoingId> {
                let mut tx = pool.begin().await.unwrap();
                let mut ids = Vec::new();
                for (index, payload) in payloads.iter().enumerate() {
                    let message = cause.nth_outgoing(index as u32, "events", payload);
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id());
                }
                tx.commit().await.unwrap();
                ids
            }

            /// A row's state, attempts and last error.
            pub(crate) async fn state(
                pool: &sqlx::Pool<$db>,
                outbox: &Outbox,
                id: OutgoingId,
            ) -> (i64, i64, Option<String>) {
                let sql = format!($state, outbox.table().name());
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .bind(id.to_string())
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// Every claim of `outbox` ends now, on the database's clock.
            pub(crate) async fn expire(pool: &sqlx::Pool<$db>, outbox: &Outbox) {
                let sql = format!($expire, outbox.table().name());
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(pool)
                    .await
                    .unwrap();
            }
        }
    };
}

outbox_backends!(common_helpers);
