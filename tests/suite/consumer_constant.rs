//! `consumer = CONSTANT` (issue 40): the name written once, for the attribute and for the
//! code that needs it too (an outbox `Cause`). The dedup rows carry the constant's value,
//! on every handler form: plain, batch, leased; and a `Cause` under the same constant
//! derives the outgoing id the handler enqueued.

use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::{Lease, idempotent};
use sqlx::SqliteConnection;

const CONSUMER: &str = "constant-consumer";

mod names {
    pub const BATCH: &str = "constant-batch";
    pub const LEASED: &str = "constant-leased";
}

#[derive(Debug, Clone)]
struct Msg {
    id: String,
}

#[idempotent(consumer = CONSUMER, key = msg.id)]
async fn plain(tx: &mut SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let cause = Cause::new(CONSUMER, msg.id.as_str())?;
    let event = cause.outgoing("event", "events", b"e")?;
    Outbox::new().enqueue(&mut *tx, &event).await?;
    Ok(())
}

#[idempotent(consumer = names::BATCH, batch = msgs, key = |msg| msg.id.as_str())]
async fn batch(tx: &mut SqliteConnection, msgs: &[&Msg]) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = msgs;
    Ok(())
}

#[idempotent(consumer = names::LEASED, key = msg.id, effect = "send-first", lease = "30s")]
async fn leased(lease: &mut Lease<'_, sqlx::Sqlite>, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (lease, msg);
    Ok(())
}

#[tokio::test]
async fn the_constant_s_value_names_the_consumer_on_every_form() {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*db).await.unwrap();
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let msg = Msg {
        id: "m1".to_owned(),
    };
    assert!(plain(&*db, &msg).await.unwrap().is_processed());
    assert!(plain(&*db, &msg).await.unwrap().is_duplicate());
    assert_eq!(dedup_suite::claims(&*db, CONSUMER, "m1").await, 1);
    let cause = Cause::new(CONSUMER, "m1").unwrap();
    let expected = cause.outgoing("event", "events", b"e").unwrap();
    let ids: Vec<Vec<u8>> = sqlx::query_scalar("SELECT id FROM outbox_messages")
        .fetch_all(&*db)
        .await
        .unwrap();
    assert_eq!(
        ids,
        [expected.id().as_uuid().as_bytes().to_vec()],
        "the id derived under the constant"
    );

    batch(&*db, std::slice::from_ref(&msg)).await.unwrap();
    assert_eq!(dedup_suite::claims(&*db, names::BATCH, "m1").await, 1);
    assert!(leased(&db, &msg).await.unwrap().is_processed());
    assert_eq!(dedup_suite::claims(&*db, names::LEASED, "m1").await, 1);
}
