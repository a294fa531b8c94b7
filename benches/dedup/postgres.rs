//! PostgreSQL's side of the targets: the SQL it is sent, and its statements of a shape of
//! their own. What both backends share is in `target.rs`.

use sqlx::postgres::PgQueryResult;
use sqlx::{PgConnection, Pool, Postgres, Transaction};

use crate::config::BackendName;
use crate::inbox_round::INBOX_TABLE;
use crate::outbox::OUTBOX_TABLE;
use crate::target::Sql;

crate::target::handlers!(sqlx::Postgres, PgConnection);

impl Sql for Postgres {
    const BACKEND: BackendName = BackendName::Postgres;
    const EFFECT: &'static str = "INSERT INTO dedup_bench_effects (message_id) VALUES ($1)";
    const CLAIM: &'static str =
        "INSERT INTO dedup_bench (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";
    const CREATE: [&'static str; 2] = [
        "CREATE TABLE IF NOT EXISTS dedup_bench_effects (message_id text NOT NULL)",
        "CREATE TABLE IF NOT EXISTS dedup_bench_meta \
         (name text PRIMARY KEY, rows bigint NOT NULL)",
    ];
    const FILLED: &'static str = "SELECT rows FROM dedup_bench_meta WHERE name = $1";

    /// `BEGIN`, as the generated code sends it.
    async fn begin(pool: &Pool<Postgres>) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        pool.begin().await
    }

    fn rows_affected(result: &PgQueryResult) -> u64 {
        result.rows_affected()
    }

    fn reset_sql() -> Vec<String> {
        vec!["TRUNCATE dedup_bench, dedup_bench_effects".to_owned()]
    }

    fn inbox_reset_sql() -> Vec<String> {
        vec![format!("TRUNCATE {INBOX_TABLE}, dedup_bench_effects")]
    }

    fn outbox_reset_sql() -> Vec<String> {
        vec![format!("TRUNCATE {OUTBOX_TABLE}")]
    }

    /// `VACUUM ANALYZE`: the table as autovacuum keeps it.
    fn tidy(table: &str) -> String {
        format!("VACUUM ANALYZE {table}")
    }

    fn fill_big(big: &str, rows: i64) -> Vec<String> {
        // Bulk load, then build the indexes the migration made by sorting: an order of
        // magnitude faster than inserting into them row by row. Ends with the same schema.
        vec![
            "SET maintenance_work_mem = '1GB'".to_owned(),
            format!("ALTER TABLE {big} DROP CONSTRAINT {big}_pkey"),
            format!("DROP INDEX {big}_processed_at_idx"),
            format!(
                "INSERT INTO {big} (consumer, message_id, processed_at) \
                 SELECT 'bench', md5(i::text), \
                        timestamptz '2020-01-01 00:00:00+00' + (i % 604800) * interval '1 second' \
                 FROM generate_series(1, {rows}) i"
            ),
            format!("ALTER TABLE {big} ADD PRIMARY KEY (consumer, message_id)"),
            format!("CREATE INDEX {big}_processed_at_idx ON {big} (processed_at)"),
            "RESET maintenance_work_mem".to_owned(),
            format!("VACUUM ANALYZE {big}"),
            format!(
                "INSERT INTO dedup_bench_meta (name, rows) VALUES ('{big}', {rows}) \
                 ON CONFLICT (name) DO UPDATE SET rows = excluded.rows"
            ),
        ]
    }

    fn fill_prune(rows: i64) -> String {
        format!(
            "INSERT INTO dedup_bench_prune (consumer, message_id, processed_at) \
             SELECT 'bench-prune', md5(i::text), now() - interval '3 days' - i * interval '1 second' \
             FROM generate_series(1, {rows}) i"
        )
    }

    /// One statement: the ids as an array.
    async fn seen(pool: &Pool<Postgres>, ids: &[String]) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO dedup_bench (consumer, message_id) SELECT 'bench', unnest($1::text[])",
        )
        .bind(ids)
        .execute(pool)
        .await?;
        Ok(())
    }

    /// One `INSERT … SELECT unnest(…)` for all fresh messages.
    async fn insert_effects(tx: &mut PgConnection, fresh: &[&String]) -> Result<(), sqlx::Error> {
        let ids: Vec<&str> = fresh.iter().map(|id| id.as_str()).collect();
        sqlx::query("INSERT INTO dedup_bench_effects (message_id) SELECT unnest($1::text[])")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}
