//! `AckPolicy` dead-lettered the error of a leased call whose lease another delivery had
//! taken over (`LeaseLost`): the message was processed (or being processed) by the new
//! owner, and its copy landed in the dead-letter queue. A lost lease is transient: the
//! redelivery is a duplicate, or in progress.

use dedup_runtime::{Ack, AckPolicy, Failure, Lease, LeaseLost, idempotent};

/// Another delivery, taking the lease over while the call runs (its owner token replaced).
struct Thief<'p>(&'p sqlx::SqlitePool);

impl Thief<'_> {
    async fn steal(&self, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE processed_messages SET owner = x'09' WHERE message_id = ?1")
            .bind(id)
            .execute(self.0)
            .await?;
        Ok(())
    }
}

#[idempotent(consumer = "regress-lease-lost", key = id, effect = "send-first", lease = "30s")]
async fn call(
    lease: &mut Lease<'_, sqlx::Sqlite>,
    id: &str,
    thief: &Thief<'_>,
) -> Result<(), sqlx::Error> {
    thief.steal(id).await
}

#[tokio::test]
async fn a_lost_lease_is_retried_not_dead_lettered() {
    let db = dedup_suite::sqlite().await;
    let result = call(&db, "evt_1", &Thief(&db)).await;
    let error = result.as_ref().unwrap_err();
    assert!(LeaseLost::find(error).is_some(), "{error:?}");
    let policy = AckPolicy::<sqlx::Sqlite>::new();
    assert_eq!(policy.failure(error), Failure::Transient);
    assert!(matches!(policy.decide(&result, 1), Ack::Retry { .. }));
    // The new owner's row is untouched: still in progress under its token.
    let (state, owner): (Option<i64>, Vec<u8>) =
        sqlx::query_as("SELECT state, owner FROM processed_messages WHERE message_id = 'evt_1'")
            .fetch_one(&*db)
            .await
            .unwrap();
    assert_eq!((state, owner), (Some(1), vec![9]));
}
