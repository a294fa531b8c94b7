//! SQLite's side of the targets: the SQL it is sent, and its statements of a shape of
//! their own. What both backends share is in `target.rs`.

use sqlx::sqlite::SqliteQueryResult;
use sqlx::{Pool, Sqlite, SqliteConnection, Transaction};

use crate::config::BackendName;
use crate::inbox_round::INBOX_TABLE;
use crate::outbox::OUTBOX_TABLE;
use crate::target::Sql;

crate::target::handlers!(sqlx::Sqlite, SqliteConnection);

/// After a bulk delete or fill: the WAL file back to nothing.
const CHECKPOINT: &str = "PRAGMA wal_checkpoint(TRUNCATE)";

impl Sql for Sqlite {
    const BACKEND: BackendName = BackendName::Sqlite;
    const EFFECT: &'static str = "INSERT INTO dedup_bench_effects (message_id) VALUES (?1)";
    const CLAIM: &'static str =
        "INSERT INTO dedup_bench (consumer, message_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING";
    const CREATE: [&'static str; 2] = [
        "CREATE TABLE IF NOT EXISTS dedup_bench_effects (message_id TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS dedup_bench_meta \
         (name TEXT PRIMARY KEY, rows INTEGER NOT NULL)",
    ];
    const FILLED: &'static str = "SELECT rows FROM dedup_bench_meta WHERE name = ?1";

    /// `BEGIN IMMEDIATE`, so that concurrent writers wait for the lock.
    async fn begin(pool: &Pool<Sqlite>) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
        pool.begin_with("BEGIN IMMEDIATE").await
    }

    fn rows_affected(result: &SqliteQueryResult) -> u64 {
        result.rows_affected()
    }

    fn reset_sql() -> Vec<String> {
        vec![
            "DELETE FROM dedup_bench".to_owned(),
            "DELETE FROM dedup_bench_effects".to_owned(),
            CHECKPOINT.to_owned(),
        ]
    }

    fn inbox_reset_sql() -> Vec<String> {
        vec![
            format!("DELETE FROM {INBOX_TABLE}"),
            "DELETE FROM dedup_bench_effects".to_owned(),
            CHECKPOINT.to_owned(),
        ]
    }

    fn outbox_reset_sql() -> Vec<String> {
        vec![format!("DELETE FROM {OUTBOX_TABLE}")]
    }

    /// A checkpoint: the WAL file truncated.
    fn tidy(_: &str) -> String {
        CHECKPOINT.to_owned()
    }

    fn fill_big(big: &str, rows: i64) -> Vec<String> {
        // Rows in key order into the table, then the processed_at index by sorting.
        vec![
            "PRAGMA cache_size = -1000000".to_owned(),
            format!("DROP INDEX {big}_processed_at_idx"),
            "BEGIN IMMEDIATE".to_owned(),
            format!(
                "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {rows}) \
                 INSERT INTO {big} (consumer, message_id, processed_at) \
                 SELECT 'bench', id, at FROM ( \
                   SELECT lower(hex(randomblob(16))) AS id, \
                          strftime('%Y-%m-%dT%H:%M:%fZ', '2020-01-01', \
                                   '+' || (i % 604800) || ' seconds') AS at \
                   FROM s) \
                 ORDER BY id"
            ),
            format!("CREATE INDEX {big}_processed_at_idx ON {big} (processed_at)"),
            format!(
                "INSERT INTO dedup_bench_meta (name, rows) VALUES ('{big}', {rows}) \
                 ON CONFLICT (name) DO UPDATE SET rows = excluded.rows"
            ),
            "COMMIT".to_owned(),
            "PRAGMA cache_size = -2000".to_owned(),
            CHECKPOINT.to_owned(),
        ]
    }

    fn fill_prune(rows: i64) -> String {
        format!(
            "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {rows}) \
             INSERT INTO dedup_bench_prune (consumer, message_id, processed_at) \
             SELECT 'bench-prune', lower(hex(randomblob(16))), \
                    strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (259200 + i) || ' seconds') \
             FROM s"
        )
    }

    /// One `INSERT` an id, in one `BEGIN IMMEDIATE` transaction.
    async fn seen(pool: &Pool<Sqlite>, ids: &[String]) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        for id in ids {
            sqlx::query("INSERT INTO dedup_bench (consumer, message_id) VALUES ('bench', ?1)")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    /// One multi-row `INSERT` for all fresh messages.
    async fn insert_effects(
        tx: &mut SqliteConnection,
        fresh: &[&String],
    ) -> Result<(), sqlx::Error> {
        let mut sql = String::from("INSERT INTO dedup_bench_effects (message_id) VALUES ");
        for n in 1..=fresh.len() {
            if n > 1 {
                sql.push_str(", ");
            }
            sql.push_str(&format!("(?{n})"));
        }
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for id in fresh {
            query = query.bind(id.as_str());
        }
        query.execute(&mut *tx).await?;
        Ok(())
    }
}
