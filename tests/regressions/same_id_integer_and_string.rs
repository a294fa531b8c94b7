//! A message id is text: `key = 42_i64` and `key = "42"` are the same id under one
//! consumer, so ids must be unique across everything that consumer handles. The README
//! recommended a bare Kafka offset or JetStream sequence as the id, which repeat across
//! partitions and streams: the second partition's offset 100 was acknowledged as a
//! duplicate of the first's (issue 8, defect 7). Integers are written as decimal text.

use dedup_runtime::{Duplicate, Outcome, idempotent};
use sqlx::SqliteConnection;

#[idempotent(consumer = "regress-same-id", key = offset)]
async fn by_integer(tx: &mut SqliteConnection, offset: i64) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (via) VALUES ('integer')")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[idempotent(consumer = "regress-same-id", key = id)]
async fn by_text(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (via) VALUES ('text')")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test]
async fn integer_42_and_text_42_are_one_id() {
    let pool = dedup_suite::sqlite().await;
    sqlx::raw_sql("CREATE TABLE effects (via TEXT NOT NULL)")
        .execute(&*pool)
        .await
        .unwrap();
    assert_eq!(
        by_integer(&*pool, 42).await.unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(
        by_text(&*pool, "42").await.unwrap(),
        Outcome::Duplicate(Duplicate::AlreadyProcessed)
    );
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT consumer, message_id FROM processed_messages")
            .fetch_all(&*pool)
            .await
            .unwrap();
    assert_eq!(rows, [("regress-same-id".to_owned(), "42".to_owned())]);
    let effects: Vec<String> = sqlx::query_scalar("SELECT via FROM effects")
        .fetch_all(&*pool)
        .await
        .unwrap();
    assert_eq!(effects, ["integer"]);
}
