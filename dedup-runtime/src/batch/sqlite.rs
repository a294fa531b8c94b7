//! SQLite: a multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING` (SQLite 3.35), in
//! statements of at most [`ROWS`] rows (a statement's parameters are limited).

use sqlx::sqlite::SqliteConnection;
use sqlx::{AssertSqlSafe, Row, Sqlite};

use super::{BatchBackend, Inspected};
use crate::claim::Found;
use crate::table::Table;

/// Rows per statement: one parameter each, and the consumer.
const ROWS: usize = 10_000;

/// `?2, ?3, …` from `first`, one per row, each in `row`'s form.
fn numbered(count: usize, first: usize, row: impl Fn(usize) -> String) -> String {
    let mut list = String::with_capacity(12 * count);
    for n in 0..count {
        if n > 0 {
            list.push_str(", ");
        }
        list.push_str(&row(first + n));
    }
    list
}

impl BatchBackend for Sqlite {
    async fn claim_many<'c>(
        conn: &'c mut SqliteConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        prints: Option<&'c [&'c [u8]]>,
        _: &'c [u8; 16],
    ) -> Result<Vec<String>, sqlx::Error> {
        let mut claimed = Vec::with_capacity(ids.len());
        let Some(prints) = prints else {
            for chunk in ids.chunks(ROWS) {
                let sql = format!(
                    "INSERT INTO {} (consumer, message_id) VALUES {} \
                     ON CONFLICT DO NOTHING RETURNING message_id",
                    table.name(),
                    numbered(chunk.len(), 2, |n| format!("(?1, ?{n})"))
                );
                let mut query = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql)).bind(consumer);
                for id in chunk {
                    query = query.bind(*id);
                }
                claimed.extend(query.fetch_all(&mut *conn).await?);
            }
            return Ok(claimed);
        };
        // Two parameters a row: half as many rows per statement.
        for (chunk, prints) in ids.chunks(ROWS / 2).zip(prints.chunks(ROWS / 2)) {
            let sql = format!(
                "INSERT INTO {} (consumer, message_id, fingerprint) VALUES {} \
                 ON CONFLICT DO NOTHING RETURNING message_id",
                table.name(),
                numbered(chunk.len(), 0, |n| format!(
                    "(?1, ?{}, ?{})",
                    2 + 2 * n,
                    3 + 2 * n
                ))
            );
            let mut query = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql)).bind(consumer);
            for (id, print) in chunk.iter().zip(prints) {
                query = query.bind(*id).bind(*print);
            }
            claimed.extend(query.fetch_all(&mut *conn).await?);
        }
        Ok(claimed)
    }

    async fn inspect_many<'c>(
        conn: &'c mut SqliteConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        printed: bool,
    ) -> Result<Vec<Inspected>, sqlx::Error> {
        let mut found = Vec::with_capacity(ids.len());
        let fingerprint = if printed { ", fingerprint" } else { "" };
        for chunk in ids.chunks(ROWS) {
            let sql = format!(
                "SELECT message_id, state, CAST(max(0, (julianday(expires_at) - \
                 julianday('now')) * 86400000000.0) AS INTEGER){fingerprint} FROM {} \
                 WHERE consumer = ?1 AND message_id IN ({})",
                table.name(),
                numbered(chunk.len(), 2, |n| format!("?{n}"))
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
                    found: Found::from_sqlite(&row, 1)?,
                    fingerprint: if printed { row.try_get(3)? } else { None },
                });
            }
        }
        Ok(found)
    }

    async fn take_over_one<'c>(
        conn: &'c mut SqliteConnection,
        table: &'c Table,
        consumer: &'c str,
        id: &'c str,
        print: Option<&'c [u8]>,
        _: &'c [u8; 16],
    ) -> Result<bool, sqlx::Error> {
        let (set, only) = match print {
            Some(_) => (
                ", fingerprint = ?3",
                " AND (fingerprint IS NULL OR fingerprint = ?3)",
            ),
            None => ("", ""),
        };
        let sql = format!(
            "UPDATE {} SET state = NULL, owner = NULL, expires_at = NULL, \
             processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'){set} \
             WHERE consumer = ?1 AND message_id = ?2 AND state = 1 \
             AND expires_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now'){only}",
            table.name()
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(consumer).bind(id);
        if let Some(print) = print {
            query = query.bind(print);
        }
        Ok(query.execute(conn).await?.rows_affected() == 1)
    }

    async fn seal_many<'c>(
        conn: &'c mut SqliteConnection,
        table: &'c Table,
        consumer: &'c str,
        fresh: &'c [&'c str],
        _: &'c [u8; 16],
        slow: bool,
    ) -> Result<(), sqlx::Error> {
        if !slow {
            return Ok(());
        }
        for chunk in fresh.chunks(ROWS) {
            let sql = format!(
                "UPDATE {} SET processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                 WHERE consumer = ?1 AND message_id IN ({})",
                table.name(),
                numbered(chunk.len(), 2, |n| format!("?{n}"))
            );
            let mut query = sqlx::query(AssertSqlSafe(sql)).bind(consumer);
            for id in chunk {
                query = query.bind(*id);
            }
            query.execute(&mut *conn).await?;
        }
        Ok(())
    }
}
