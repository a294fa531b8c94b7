//! Issue 24, item 3: a batch with one message whose failure shows only at `COMMIT` — a
//! deferred foreign key (PostgreSQL 23503 at `COMMIT`, SQLite 787), or on PostgreSQL a
//! statement error the body swallowed (the transaction aborted: `RolledBack` at the
//! commit) — ended the whole call with the error: none of the good messages committed,
//! and every redelivery failed the same way, the poison the batch form exists to
//! prevent. A permanent failure at `COMMIT` now splits the batch like a failure of the
//! body, down to the message: the good ones commit, the bad one is
//! `BatchItem::CommitFailed` with the database's error. Checked with the effects and the
//! dedup rows read back.

use dedup_runtime::batch::BatchItem;
use dedup_runtime::{AckPolicy, RolledBack, idempotent};
use dedup_suite::{claims, unique};

const CONSUMER: &str = "regress-commit-fails";

/// A message: its id and the parent row its effect references (deferred).
struct Msg {
    id: String,
    parent: i64,
}

fn batch_of(prefix: &str, parents: &[i64]) -> Vec<Msg> {
    parents
        .iter()
        .map(|&parent| Msg {
            id: unique(prefix),
            parent,
        })
        .collect()
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, ddl = $ddl:literal,
     record = $record:literal, code = $code:literal) => {
        mod $backend {
            use super::*;

            /// One child row per message; the foreign key is checked at `COMMIT`.
            #[idempotent(consumer = "regress-commit-fails", batch = fresh, key = |msg| msg.id.as_str())]
            async fn record(tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    sqlx::query($record)
                        .bind(msg.id.as_str())
                        .bind(msg.parent)
                        .execute(&mut *tx)
                        .await?;
                }
                Ok(())
            }

            async fn effects(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "regress_commit_child", "message_id", id).await
            }

            #[tokio::test]
            async fn a_deferred_constraint_fails_one_message_and_the_rest_commits() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_suite::ddl(pool, $ddl).await;
                // Parent 1 exists; parent 404 does not: the third message is the poison.
                let batch = batch_of("regress-commit", &[1, 1, 404, 1, 1]);
                let outcome = record(pool, &batch).await.expect("the call itself succeeds");
                for (n, msg) in batch.iter().enumerate() {
                    if n == 2 {
                        let BatchItem::CommitFailed(error) = &outcome.items()[n] else {
                            panic!("{outcome:?}");
                        };
                        assert_eq!(dedup_suite::error_code(error).as_deref(), Some($code), "{error}");
                        assert!(!outcome.ack(n));
                        let ack = AckPolicy::<$db>::new().decide_error(error, 1);
                        assert_eq!(ack, dedup_runtime::Ack::DeadLetter);
                        assert_eq!(effects(pool, &msg.id).await, 0);
                        assert_eq!(claims(pool, CONSUMER, &msg.id).await, 0);
                    } else {
                        assert!(matches!(outcome.items()[n], BatchItem::Processed), "{outcome:?}");
                        assert_eq!(effects(pool, &msg.id).await, 1);
                        assert_eq!(claims(pool, CONSUMER, &msg.id).await, 1);
                    }
                }
                assert_eq!(outcome.processed(), 4);
                assert_eq!(outcome.failed(), 1);
                // The redelivery: four duplicates, the poison alone fails again.
                let again = record(pool, &batch).await.unwrap();
                assert_eq!(again.duplicates(), 4);
                assert!(matches!(again.items()[2], BatchItem::CommitFailed(_)), "{again:?}");
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    ddl = "CREATE TABLE IF NOT EXISTS regress_commit_parent (id int8 PRIMARY KEY); \
           INSERT INTO regress_commit_parent (id) VALUES (1) ON CONFLICT DO NOTHING; \
           CREATE TABLE IF NOT EXISTS regress_commit_child (message_id text NOT NULL, \
           parent int8 NOT NULL REFERENCES regress_commit_parent (id) \
           DEFERRABLE INITIALLY DEFERRED)",
    record = "INSERT INTO regress_commit_child (message_id, parent) VALUES ($1, $2)",
    code = "23503"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    ddl = "CREATE TABLE IF NOT EXISTS regress_commit_parent (id INTEGER PRIMARY KEY); \
           INSERT OR IGNORE INTO regress_commit_parent (id) VALUES (1); \
           CREATE TABLE IF NOT EXISTS regress_commit_child (message_id TEXT NOT NULL, \
           parent INTEGER NOT NULL REFERENCES regress_commit_parent (id) \
           DEFERRABLE INITIALLY DEFERRED)",
    record = "INSERT INTO regress_commit_child (message_id, parent) VALUES (?1, ?2)",
    code = "787"
);

/// PostgreSQL: a body that swallows one message's failed statement leaves the
/// transaction aborted; its `COMMIT` is `RolledBack`. Retried, then split down to that
/// message, which alone fails.
mod postgres_swallowed {
    use super::*;

    #[idempotent(consumer = "regress-commit-fails", batch = fresh, key = |msg| msg.id.as_str())]
    async fn swallow(tx: &mut sqlx::PgConnection, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
        for msg in fresh {
            if msg.parent == 404 {
                // The mistake: the error is dropped, the transaction is aborted.
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
                continue;
            }
            let _ = sqlx::query(
                "INSERT INTO regress_commit_child (message_id, parent) VALUES ($1, $2)",
            )
            .bind(msg.id.as_str())
            .bind(msg.parent)
            .execute(&mut *tx)
            .await;
        }
        Ok(())
    }

    #[tokio::test]
    async fn a_swallowed_error_fails_one_message_and_the_rest_commits() {
        let pool = dedup_suite::postgres().await;
        dedup_suite::ddl(
            &pool,
            "CREATE TABLE IF NOT EXISTS regress_commit_parent (id int8 PRIMARY KEY); \
             INSERT INTO regress_commit_parent (id) VALUES (1) ON CONFLICT DO NOTHING; \
             CREATE TABLE IF NOT EXISTS regress_commit_child (message_id text NOT NULL, \
             parent int8 NOT NULL REFERENCES regress_commit_parent (id) \
             DEFERRABLE INITIALLY DEFERRED)",
        )
        .await;
        let batch = batch_of("regress-commit-swallow", &[1, 404, 1]);
        let outcome = swallow(&pool, &batch)
            .await
            .expect("the call itself succeeds");
        let BatchItem::CommitFailed(error) = &outcome.items()[1] else {
            panic!("{outcome:?}");
        };
        assert!(RolledBack::find(error).is_some(), "{error}");
        for n in [0, 2] {
            assert!(
                matches!(outcome.items()[n], BatchItem::Processed),
                "{outcome:?}"
            );
            assert_eq!(
                dedup_suite::rows(&pool, "regress_commit_child", "message_id", &batch[n].id).await,
                1
            );
            assert_eq!(claims(&pool, CONSUMER, &batch[n].id).await, 1);
        }
        assert_eq!(claims(&pool, CONSUMER, &batch[1].id).await, 0);
    }
}
