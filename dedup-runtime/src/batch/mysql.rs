//! MySQL and MariaDB: a multi-row `INSERT … ON DUPLICATE KEY UPDATE` that writes this
//! transaction's token into the new rows' `owner`, and a read of the ids that hold it
//! (MySQL has no `RETURNING`; MariaDB's would return the rows already there too). The
//! seal clears the token and stamps the commit time, and fails unless every fresh row is
//! still this transaction's: InnoDB ends a transaction by itself on a deadlock, and a body
//! that swallowed the error would go on in a new one.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, MySql};

use super::BatchBackend;
use crate::rolled_back::RolledBack;
use crate::schema::Table;
use crate::schema::mysql::placeholders;

/// Rows per statement (a statement's parameters are limited to 65,535).
const ROWS: usize = 10_000;

impl BatchBackend for MySql {
    async fn claim_many<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        token: &'c [u8; 16],
    ) -> Result<Vec<String>, sqlx::Error> {
        let name = table.name();
        let mut claimed = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(ROWS) {
            let mut values = String::with_capacity(40 * chunk.len());
            for n in 0..chunk.len() {
                if n > 0 {
                    values.push_str(", ");
                }
                values.push_str("(?, ?, UTC_TIMESTAMP(6), ?)");
            }
            // A row already there is left as it is (`consumer = consumer` changes nothing),
            // after waiting for its lock: a concurrent batch's row counts once it commits.
            let insert = format!(
                "INSERT INTO {name} (consumer, message_id, processed_at, owner) VALUES {values} \
                 ON DUPLICATE KEY UPDATE consumer = consumer"
            );
            let mut query = sqlx::query(AssertSqlSafe(insert));
            for id in chunk {
                query = query.bind(consumer).bind(*id).bind(&token[..]);
            }
            query.execute(&mut *conn).await?;
            let select = format!(
                "SELECT CAST(message_id AS CHAR) FROM {name} \
                 WHERE consumer = ? AND owner = ? AND message_id IN ({})",
                placeholders(chunk.len())
            );
            let mut query = sqlx::query_scalar::<_, String>(AssertSqlSafe(select))
                .bind(consumer)
                .bind(&token[..]);
            for id in chunk {
                query = query.bind(*id);
            }
            claimed.extend(query.fetch_all(&mut *conn).await?);
        }
        Ok(claimed)
    }

    async fn seal_many<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c Table,
        consumer: &'c str,
        fresh: &'c [&'c str],
        token: &'c [u8; 16],
        _: bool,
    ) -> Result<(), sqlx::Error> {
        let mut sealed = 0;
        for chunk in fresh.chunks(ROWS) {
            let sql = format!(
                "UPDATE {} SET processed_at = UTC_TIMESTAMP(6), owner = NULL \
                 WHERE consumer = ? AND owner = ? AND message_id IN ({})",
                table.name(),
                placeholders(chunk.len())
            );
            let mut query = sqlx::query(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(&token[..]);
            for id in chunk {
                query = query.bind(*id);
            }
            sealed += query.execute(&mut *conn).await?.rows_affected();
        }
        if sealed != fresh.len() as u64 {
            return Err(RolledBack::error("MySQL", None));
        }
        Ok(())
    }
}
