//! SQLite: `BEGIN IMMEDIATE` so that writers wait for the lock instead of failing,
//! `INSERT … ON CONFLICT DO NOTHING`, extended result codes.

use std::error::Error as StdError;

use sqlx::error::DatabaseError;
use sqlx::sqlite::{SqliteConnection, SqliteError};
use sqlx::{AssertSqlSafe, Connection, Pool, Sqlite, Transaction};

use sqlx_core::transaction::TransactionManager;

use super::{Backend, Statements, Tx, Violation};
use crate::migrate::Table;
use crate::rolled_back::RolledBack;
use crate::run::Claimed;

type Manager = <Sqlite as sqlx::Database>::TransactionManager;

super::connection_impls!(Sqlite, SqliteConnection);

const SQLITE_CONSTRAINT_UNIQUE: i64 = 2067;
const SQLITE_CONSTRAINT_PRIMARYKEY: i64 = 1555;

/// The table and columns (or expression index) of a `UNIQUE constraint failed` message.
fn parse_violation(message: &str) -> Option<Violation> {
    let detail = message.strip_prefix("UNIQUE constraint failed: ")?;
    if let Some(name) = detail
        .strip_prefix("index '")
        .and_then(|rest| rest.strip_suffix('\''))
    {
        return Some(Violation::Named(name.to_owned()));
    }
    let mut table = None;
    let mut columns = Vec::new();
    for qualified in detail.split(", ") {
        let (t, column) = qualified.rsplit_once('.')?;
        if *table.get_or_insert(t) != t {
            return None;
        }
        columns.push(column.to_owned());
    }
    Some(Violation::Columns {
        table: table?.to_owned(),
        columns,
    })
}

/// The table and columns of the index `name`, in index order; `None` when there is no
/// such index (or it is on expressions).
async fn index_columns(
    conn: &mut SqliteConnection,
    name: &str,
) -> Result<Option<(String, Vec<String>)>, sqlx::Error> {
    let table: Option<String> = sqlx::query_scalar(
        "SELECT tbl_name FROM sqlite_master WHERE type = 'index' AND name = ?1 COLLATE NOCASE",
    )
    .bind(name)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(table) = table else {
        return Ok(None);
    };
    let columns: Vec<Option<String>> =
        sqlx::query_scalar("SELECT name FROM pragma_index_info(?1) ORDER BY seqno")
            .bind(name)
            .fetch_all(&mut *conn)
            .await?;
    let columns: Option<Vec<String>> = columns.into_iter().collect();
    Ok(columns
        .filter(|columns| !columns.is_empty())
        .map(|columns| (table, columns)))
}

/// SQLITE_BUSY and SQLITE_LOCKED, the primary codes under every extended code.
const TRANSIENT: [i64; 2] = [5, 6];

/// Takes the write lock at `BEGIN`: a deferred transaction that reads first and writes
/// later can fail with `SQLITE_BUSY` without waiting, where this one waits.
const BEGIN: &str = "BEGIN IMMEDIATE";

/// After a failed `COMMIT` or `ROLLBACK` of a transaction the handler owns: whether SQLite
/// had ended the transaction by itself (an automatic rollback: `SQLITE_FULL`, an I/O
/// error, `RAISE(ROLLBACK, …)`, `ON CONFLICT ROLLBACK`), and sqlx's bookkeeping brought
/// back to no transaction either way.
///
/// sqlx still counts the transaction open (its end failed), so it would answer the
/// connection's next `BEGIN IMMEDIATE` with `InvalidSavePointStatement` for as long as
/// the connection lives. A plain `BEGIN` succeeds exactly when SQLite is in autocommit
/// mode; then there is a transaction again for sqlx's own `ROLLBACK` to end.
async fn repair(tx: &mut sqlx::Transaction<'_, Sqlite>) -> bool {
    let ended = sqlx::raw_sql("BEGIN").execute(&mut **tx).await.is_ok();
    if let Err(error) = Manager::rollback(&mut **tx).await {
        tracing::debug!(%error, "rollback after an automatic rollback failed");
    }
    ended
}

impl Backend for Sqlite {
    fn claim_sql(statements: &Statements) -> &'static str {
        statements.sqlite
    }

    async fn claim<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<bool, sqlx::Error> {
        let done = super::execute_keyed::<Self>(conn, sql, consumer, id).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn stamp<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<(), sqlx::Error> {
        super::execute_keyed::<Self>(conn, sql, consumer, id)
            .await
            .map(drop)
    }

    fn stamp_sql(statements: &Statements) -> Option<&'static str> {
        Some(statements.sqlite_stamp)
    }

    /// SQLite has no aborted state: a transaction it rolled back by itself makes `COMMIT`
    /// fail ("no transaction is active"). The commit goes through sqlx's transaction
    /// manager, so that the `Transaction` stays at hand for [`repair`].
    async fn commit_owned<'t>(
        tx: Tx<'t, Self>,
        claimed: Option<Claimed<'t>>,
        _: bool,
    ) -> Result<(), sqlx::Error> {
        let mut tx = tx.tx;
        let mut result = Ok(());
        if let Some(claimed) = claimed.filter(|claimed| claimed.slow) {
            result = Self::stamp(
                &mut tx,
                claimed.statements.sqlite_stamp,
                claimed.consumer,
                claimed.id,
            )
            .await;
        }
        if result.is_ok() {
            result = Manager::commit(&mut tx).await;
        }
        match result {
            // Committed, and counted so by sqlx; dropping `tx` would send its worker a
            // `ROLLBACK` to skip. `tx` only borrows the connection (the handler begins
            // every transaction on `&mut` a connection), so forgetting it leaks nothing.
            Ok(()) => {
                std::mem::forget(tx);
                Ok(())
            }
            Err(error) if repair(&mut tx).await => Err(RolledBack::error("SQLite", Some(error))),
            Err(error) => Err(error),
        }
    }

    async fn rollback_owned<'t>(
        tx: Tx<'t, Self>,
        pooled: bool,
        wrote: bool,
    ) -> Result<(), sqlx::Error> {
        let mut tx = tx.tx;
        if pooled && !wrote {
            drop(tx);
            return Ok(());
        }
        match Manager::rollback(&mut tx).await {
            Ok(()) => Ok(()),
            Err(error) => {
                repair(&mut tx).await;
                Err(error)
            }
        }
    }

    fn begin_owned(
        conn: &mut SqliteConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin_with(BEGIN)
    }

    fn begin_nested(
        conn: &mut SqliteConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin()
    }

    /// Extended codes 2067 (UNIQUE) and 1555 (PRIMARY KEY) come with a message of one
    /// fixed, untranslated format: `UNIQUE constraint failed: t.a, t.b`, or
    /// `UNIQUE constraint failed: index 'name'` for an index on expressions.
    fn unique_violation_link(error: &(dyn StdError + 'static)) -> Option<Violation> {
        let error = error.downcast_ref::<SqliteError>()?;
        let code = error.code()?.parse::<i64>().ok()?;
        if code != SQLITE_CONSTRAINT_UNIQUE && code != SQLITE_CONSTRAINT_PRIMARYKEY {
            return None;
        }
        parse_violation(error.message())
    }

    /// SQLite reports columns, not the index: resolve each named index to its table and
    /// columns (in index order) and compare; `table.column` names compare directly.
    async fn matching(
        conn: &mut SqliteConnection,
        violation: Violation,
        names: &'static [&'static str],
    ) -> Option<&'static str> {
        if let Some(name) = super::matching_name(&violation, names) {
            return Some(name);
        }
        let Violation::Columns { table, columns } = violation else {
            return None;
        };
        for &name in names {
            let (index_table, index_columns) = match name.split_once('.') {
                Some((table, column)) => (table.to_owned(), vec![column.to_owned()]),
                None => match index_columns(conn, name).await {
                    Ok(Some(found)) => found,
                    Ok(None) => continue,
                    Err(error) => {
                        tracing::debug!(%error, name, "cannot resolve a unique index");
                        continue;
                    }
                },
            };
            let same = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
            if same(&index_table, &table)
                && index_columns.len() == columns.len()
                && index_columns.iter().zip(&columns).all(|(a, b)| same(a, b))
            {
                return Some(name);
            }
        }
        None
    }

    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool {
        // The driver reports the extended result code as its decimal number.
        error
            .downcast_ref::<SqliteError>()
            .and_then(|error| error.code())
            .and_then(|code| code.parse::<i64>().ok())
            .is_some_and(|code| TRANSIENT.contains(&(code & 0xff)))
    }

    fn ddl(table: &Table) -> Vec<String> {
        let name = table.name();
        let index = match table.schema() {
            Some(schema) => format!("{schema}.{}_processed_at_idx", table.base()),
            None => format!("{}_processed_at_idx", table.base()),
        };
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 consumer     TEXT NOT NULL,\n    \
                 message_id   TEXT NOT NULL,\n    \
                 processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),\n    \
                 PRIMARY KEY (consumer, message_id)\n\
                 ) WITHOUT ROWID"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {index} ON {} (processed_at)",
                table.base()
            ),
        ]
    }

    async fn create(pool: &Pool<Self>, ddl: Vec<String>) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin_with(BEGIN).await?;
        for statement in ddl {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }
}

#[cfg(test)]
mod tests {
    use super::{Violation, parse_violation};

    #[test]
    fn parses_the_fixed_message_format() {
        assert_eq!(
            parse_violation("UNIQUE constraint failed: shipments.order_id"),
            Some(Violation::Columns {
                table: "shipments".into(),
                columns: vec!["order_id".into()]
            })
        );
        assert_eq!(
            parse_violation("UNIQUE constraint failed: t.a, t.b"),
            Some(Violation::Columns {
                table: "t".into(),
                columns: vec!["a".into(), "b".into()]
            })
        );
        assert_eq!(
            parse_violation("UNIQUE constraint failed: index 'by_lower_email'"),
            Some(Violation::Named("by_lower_email".into()))
        );
        assert_eq!(parse_violation("NOT NULL constraint failed: t.a"), None);
    }
}
