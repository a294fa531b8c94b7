//! MariaDB's (or MySQL's) side of the targets: the SQL it is sent, and its statements of a
//! shape of their own. What the backends share is in `target.rs`. MariaDB takes part in
//! the per-message group (`per_message.rs`); the rest of [`Sql`] is here so that it is a
//! target like the others.

use sqlx::mysql::MySqlQueryResult;
use sqlx::{MySql, MySqlConnection, Pool, Transaction};

use crate::config::BackendName;
use crate::inbox_round::INBOX_TABLE;
use crate::outbox::OUTBOX_TABLE;
use crate::target::Sql;

crate::target::handlers!(sqlx::MySql, MySqlConnection);

/// Ids per multi-row statement of [`Sql::seen`].
const CHUNK: usize = 1_000;

/// The integers 1 to `rows` as a derived table `(n)`: cross joins of ten digits (MySQL
/// limits recursive CTEs to 1,000 levels by default, and MariaDB's `seq_1_to_n` is an
/// engine MySQL lacks).
fn numbers(rows: i64) -> String {
    let places = rows.saturating_sub(1).max(1).to_string().len();
    let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                  UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                  UNION ALL SELECT 8 UNION ALL SELECT 9)";
    let sum: Vec<String> = (0..places)
        .map(|place| format!("{} * d{place}.d", 10_i64.pow(place as u32)))
        .collect();
    let from: Vec<String> = (0..places)
        .map(|place| format!("{digits} d{place}"))
        .collect();
    format!(
        "SELECT n FROM (SELECT 1 + {} AS n FROM {}) numbers WHERE n <= {rows}",
        sum.join(" + "),
        from.join(" CROSS JOIN ")
    )
}

impl Sql for MySql {
    const BACKEND: BackendName = BackendName::Mariadb;
    const EFFECT: &'static str = "INSERT INTO dedup_bench_effects (message_id) VALUES (?)";
    /// The claim as a hand-writer writes it on MySQL: `INSERT IGNORE`, zero rows for a
    /// duplicate. The generated code sends a plain `INSERT` of the same row and reads its
    /// duplicate-key error (`INSERT IGNORE` would turn other errors into warnings): the
    /// same row written in one round trip; only a duplicate's answer differs.
    const CLAIM: &'static str = "INSERT IGNORE INTO dedup_bench (consumer, message_id, processed_at) \
         VALUES (?, ?, UTC_TIMESTAMP(6))";
    const CREATE: [&'static str; 2] = [
        "CREATE TABLE IF NOT EXISTS dedup_bench_effects \
         (message_id VARCHAR(255) NOT NULL) ENGINE = InnoDB",
        "CREATE TABLE IF NOT EXISTS dedup_bench_meta \
         (name VARCHAR(255) PRIMARY KEY, `rows` BIGINT NOT NULL) ENGINE = InnoDB",
    ];
    const FILLED: &'static str = "SELECT `rows` FROM dedup_bench_meta WHERE name = ?";

    /// `BEGIN`, sqlx's own (the generated code sends `SET autocommit = 0; BEGIN` in one
    /// round trip, for its checked commit).
    async fn begin(pool: &Pool<MySql>) -> Result<Transaction<'static, MySql>, sqlx::Error> {
        pool.begin().await
    }

    fn rows_affected(result: &MySqlQueryResult) -> u64 {
        result.rows_affected()
    }

    fn reset_sql() -> Vec<String> {
        vec![
            "TRUNCATE dedup_bench".to_owned(),
            "TRUNCATE dedup_bench_effects".to_owned(),
        ]
    }

    fn inbox_reset_sql() -> Vec<String> {
        vec![
            format!("TRUNCATE {INBOX_TABLE}"),
            "TRUNCATE dedup_bench_effects".to_owned(),
        ]
    }

    fn outbox_reset_sql() -> Vec<String> {
        vec![format!("TRUNCATE {OUTBOX_TABLE}")]
    }

    /// `ANALYZE TABLE`: fresh statistics after the bulk change.
    fn tidy(table: &str) -> String {
        format!("ANALYZE TABLE {table}")
    }

    fn fill_big(big: &str, rows: i64) -> Vec<String> {
        // Rows in key order into the clustered primary key, then the processed_at index
        // by sorting. Ends with the same schema.
        vec![
            format!("ALTER TABLE {big} DROP INDEX processed_at_idx"),
            format!(
                "INSERT INTO {big} (consumer, message_id, processed_at) \
                 SELECT 'bench', MD5(n), \
                        TIMESTAMP('2020-01-01 00:00:00') + INTERVAL (n % 604800) SECOND \
                 FROM ({}) s ORDER BY MD5(n)",
                numbers(rows)
            ),
            format!("ALTER TABLE {big} ADD INDEX processed_at_idx (processed_at)"),
            format!("ANALYZE TABLE {big}"),
            format!(
                "INSERT INTO dedup_bench_meta (name, `rows`) VALUES ('{big}', {rows}) \
                 ON DUPLICATE KEY UPDATE `rows` = VALUES(`rows`)"
            ),
        ]
    }

    fn fill_prune(rows: i64) -> String {
        format!(
            "INSERT INTO dedup_bench_prune (consumer, message_id, processed_at) \
             SELECT 'bench-prune', MD5(CONCAT('prune-', n)), \
                    UTC_TIMESTAMP(6) - INTERVAL (259200 + n) SECOND \
             FROM ({}) s",
            numbers(rows)
        )
    }

    /// Multi-row `INSERT`s of 1,000 ids, in one transaction.
    async fn seen(pool: &Pool<MySql>, ids: &[String]) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        for chunk in ids.chunks(CHUNK) {
            let sql = format!(
                "INSERT INTO dedup_bench (consumer, message_id) VALUES {}",
                vec!["('bench', ?)"; chunk.len()].join(", ")
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(id.as_str());
            }
            query.execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    /// One multi-row `INSERT` for all fresh messages.
    async fn insert_effects(
        tx: &mut MySqlConnection,
        fresh: &[&String],
    ) -> Result<(), sqlx::Error> {
        let sql = format!(
            "INSERT INTO dedup_bench_effects (message_id) VALUES {}",
            vec!["(?)"; fresh.len()].join(", ")
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for id in fresh {
            query = query.bind(id.as_str());
        }
        query.execute(&mut *tx).await?;
        Ok(())
    }
}
