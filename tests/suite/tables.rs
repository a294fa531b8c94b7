//! `table = "…"`: a custom dedup table, schema-qualified on PostgreSQL and
//! database-qualified on MariaDB, created by `migrate_table` and kept apart from the
//! default `processed_messages`.

use dedup_runtime::{Duplicate, Outcome, idempotent};

#[idempotent(consumer = "audit", key = id, table = "dedup_audit.processed")]
async fn audited_pg(tx: &mut sqlx::PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

#[idempotent(consumer = "audit", key = id, table = "test.dedup_audit_processed")]
async fn audited_mysql(tx: &mut sqlx::MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

#[tokio::test]
async fn postgres_schema_qualified_table() {
    let pool = dedup_suite::postgres().await;
    sqlx::raw_sql("CREATE SCHEMA IF NOT EXISTS dedup_audit")
        .execute(&pool)
        .await
        .ok(); // a concurrent run may create it first; migrate_table below must succeed
    dedup_runtime::migrate_table(&pool, "dedup_audit.processed")
        .await
        .unwrap();
    dedup_runtime::migrate_table(&pool, "dedup_audit.processed")
        .await
        .unwrap();

    let id = dedup_suite::unique("audit");
    assert_eq!(
        audited_pg(&pool, &id).await.unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(
        audited_pg(&pool, &id).await.unwrap(),
        Outcome::Duplicate(Duplicate::AlreadyProcessed)
    );
    let in_custom = dedup_suite::claims_in(&pool, "dedup_audit.processed", "audit", &id).await;
    let in_default = dedup_suite::claims(&pool, "audit", &id).await;
    assert_eq!((in_custom, in_default), (1, 0));
}

#[tokio::test]
async fn mysql_database_qualified_table() {
    let pool = dedup_suite::mysql().await;
    dedup_runtime::migrate_table(&pool, "test.dedup_audit_processed")
        .await
        .unwrap();
    let id = dedup_suite::unique("audit");
    assert!(audited_mysql(&pool, &id).await.unwrap().is_processed());
    assert!(audited_mysql(&pool, &id).await.unwrap().is_duplicate());
    let in_custom = dedup_suite::claims_in(&pool, "test.dedup_audit_processed", "audit", &id).await;
    let in_default = dedup_suite::claims(&pool, "audit", &id).await;
    assert_eq!((in_custom, in_default), (1, 0));
}
