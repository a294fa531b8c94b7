//! MySQL and MariaDB: a multi-row `INSERT … ON DUPLICATE KEY UPDATE` that writes this
//! transaction's token into the new rows' `owner`, and a read of the ids that hold it
//! (MySQL has no `RETURNING`; MariaDB's would return the rows already there too). The
//! seal clears the token and stamps the commit time, and fails unless every fresh row is
//! still this transaction's: InnoDB ends a transaction by itself on a deadlock, and a body
//! that swallowed the error would go on in a new one.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, MySql, Row};

use super::{BatchBackend, Inspected};
use crate::claim::Found;
use crate::dialect::mysql::placeholders;
use crate::rolled_back::RolledBack;
use crate::table::Table;

/// Rows per statement (a statement's parameters are limited to 65,535).
const ROWS: usize = 10_000;

impl BatchBackend for MySql {
    async fn claim_many<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        prints: Option<&'c [&'c [u8]]>,
        token: &'c [u8; 16],
    ) -> Result<Vec<String>, sqlx::Error> {
        let name = table.name();
        let mut claimed = Vec::with_capacity(ids.len());
        for (at, chunk) in ids.chunks(ROWS).enumerate() {
            let (row, fingerprint) = match prints {
                Some(_) => ("(?, ?, UTC_TIMESTAMP(6), ?, ?)", ", fingerprint"),
                None => ("(?, ?, UTC_TIMESTAMP(6), ?)", ""),
            };
            let mut values = String::with_capacity((row.len() + 2) * chunk.len());
            for n in 0..chunk.len() {
                if n > 0 {
                    values.push_str(", ");
                }
                values.push_str(row);
            }
            // A row already there is left as it is (`consumer = consumer` changes nothing),
            // after waiting for its lock: a concurrent batch's row counts once it commits.
            let insert = format!(
                "INSERT INTO {name} (consumer, message_id, processed_at, owner{fingerprint}) \
                 VALUES {values} ON DUPLICATE KEY UPDATE consumer = consumer"
            );
            let mut query = sqlx::query(AssertSqlSafe(insert));
            for (n, id) in chunk.iter().enumerate() {
                query = query.bind(consumer).bind(*id).bind(&token[..]);
                if let Some(prints) = prints {
                    query = query.bind(prints[at * ROWS + n]);
                }
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

    async fn inspect_many<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        printed: bool,
    ) -> Result<Vec<Inspected>, sqlx::Error> {
        let mut found = Vec::with_capacity(ids.len());
        let fingerprint = if printed { ", fingerprint" } else { "" };
        for chunk in ids.chunks(ROWS) {
            // A locking read: the latest committed rows, whatever the snapshot.
            let sql = format!(
                "SELECT CAST(message_id AS CHAR), state, GREATEST(0, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)){fingerprint} FROM {} \
                 WHERE consumer = ? AND message_id IN ({}) LOCK IN SHARE MODE",
                table.name(),
                placeholders(chunk.len())
            );
            let mut query = sqlx::query(AssertSqlSafe(sql)).bind(consumer);
            for id in chunk {
                query = query.bind(*id);
            }
            let rows = match query.fetch_all(&mut *conn).await {
                Ok(rows) => rows,
                // A table of migration `0001`, not upgraded yet: no `state`, only processed rows.
                Err(error) if !printed && crate::claim::missing_state_column(&error) => {
                    return Ok(ids.iter().map(|id| Inspected::processed(id)).collect());
                }
                Err(error) => return Err(error),
            };
            for row in rows {
                found.push(Inspected {
                    id: row.try_get(0)?,
                    found: Found::from_mysql(&row, 1)?,
                    fingerprint: if printed { row.try_get(3)? } else { None },
                });
            }
        }
        Ok(found)
    }

    /// The row's `owner` becomes this transaction's token: the seal checks it. The
    /// fingerprint is bound twice (positional parameters).
    async fn take_over_one<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c Table,
        consumer: &'c str,
        id: &'c str,
        print: Option<&'c [u8]>,
        token: &'c [u8; 16],
    ) -> Result<bool, sqlx::Error> {
        let (set, only) = match print {
            Some(_) => (
                ", fingerprint = ?",
                " AND (fingerprint IS NULL OR fingerprint = ?)",
            ),
            None => ("", ""),
        };
        let sql = format!(
            "UPDATE {} SET state = NULL, owner = ?, expires_at = NULL, \
             processed_at = UTC_TIMESTAMP(6){set} \
             WHERE consumer = ? AND message_id = ? AND state = 1 \
             AND expires_at <= UTC_TIMESTAMP(6){only}",
            table.name()
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(&token[..]);
        if let Some(print) = print {
            query = query.bind(print);
        }
        query = query.bind(consumer).bind(id);
        if let Some(print) = print {
            query = query.bind(print);
        }
        Ok(query.execute(conn).await?.rows_affected() == 1)
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
