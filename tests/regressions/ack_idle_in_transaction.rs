//! `AckPolicy` dead-lettered a message whose session PostgreSQL had ended for idling in
//! its transaction (FATAL `25P03`, `idle_in_transaction_session_timeout`): the code is
//! not in the classes `08`, `53`, `57` that `Failure::of` calls "unavailable", yet nothing
//! of the transaction stayed and a redelivery succeeds. It is transient, like `57P01`;
//! so is `25P04` (`transaction_timeout`, PostgreSQL 17) (issue 8, defect 10).

use std::time::Duration;

use dedup_runtime::{Ack, AckPolicy, Duplicate, Outcome, idempotent};
use dedup_suite::{claims, rows};
use sqlx::{Connection as _, PgConnection};

/// A message whose processing waits `stall` between its two statements, as a body that
/// calls out to a slow service in the middle of its transaction does.
struct Slow {
    id: String,
    stall: Duration,
}

#[idempotent(consumer = "regress-idle-in-transaction", key = msg.id)]
async fn record(tx: &mut PgConnection, msg: &Slow) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO dedup_regress_idle_effects (message_id) VALUES ($1)")
        .bind(&msg.id)
        .execute(&mut *tx)
        .await?;
    tokio::time::sleep(msg.stall).await;
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

#[tokio::test]
async fn idle_in_transaction_timeout_is_retried_not_dead_lettered() {
    let pool = dedup_suite::postgres().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS dedup_regress_idle_effects (message_id text NOT NULL)",
    )
    .await;

    // A session that the server ends after 200 ms idle inside a transaction.
    let mut conn = PgConnection::connect(&dedup_suite::postgres_url())
        .await
        .expect("PostgreSQL is not reachable");
    sqlx::raw_sql("SET idle_in_transaction_session_timeout = '200ms'")
        .execute(&mut conn)
        .await
        .unwrap();

    let msg = Slow {
        id: dedup_suite::unique("idle"),
        stall: Duration::from_secs(1),
    };
    let result = record(&mut conn, &msg).await;
    let error = result.as_ref().expect_err("the server ended the session");
    assert_eq!(
        dedup_suite::error_code(error).as_deref(),
        Some("25P03"),
        "{error:?}"
    );

    let policy = AckPolicy::<sqlx::Postgres>::new();
    assert_eq!(
        policy.decide(&result, 1),
        Ack::Retry {
            after: Duration::from_secs(1)
        },
        "{error}"
    );

    // Nothing of the transaction stayed: no dedup row, no effect.
    const CONSUMER: &str = "regress-idle-in-transaction";
    const EFFECTS: &str = "dedup_regress_idle_effects";
    assert_eq!(claims(&pool, CONSUMER, &msg.id).await, 0);
    assert_eq!(rows(&pool, EFFECTS, "message_id", &msg.id).await, 0);

    // The redelivery succeeds, once.
    let again = Slow {
        id: msg.id.clone(),
        stall: Duration::ZERO,
    };
    assert_eq!(record(&pool, &again).await.unwrap(), Outcome::Processed(()));
    assert_eq!(
        record(&pool, &again).await.unwrap(),
        Outcome::Duplicate(Duplicate::AlreadyProcessed)
    );
    assert_eq!(claims(&pool, CONSUMER, &msg.id).await, 1);
    assert_eq!(rows(&pool, EFFECTS, "message_id", &msg.id).await, 1);
}
