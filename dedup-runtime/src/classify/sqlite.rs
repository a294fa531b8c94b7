//! SQLite: extended result codes, and the fixed format of its unique-violation message.

use std::error::Error as StdError;

use sqlx::Sqlite;
use sqlx::error::DatabaseError;
use sqlx::sqlite::{SqliteConnection, SqliteError};

use super::{ClassifyBackend, Violation};
use crate::table::Table;

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

/// SQLITE_ERROR: a generic error, whose message says which. SQLite's messages are never
/// translated, and this one has one fixed format, `no such table: <name as written>`.
const SQLITE_ERROR: &str = "1";

/// Whether SQLite's error `code` and `message` say that `table` does not exist.
fn no_such_table(code: Option<&str>, message: &str, table: &Table) -> bool {
    code == Some(SQLITE_ERROR) && message.strip_prefix("no such table: ") == Some(table.name())
}

impl ClassifyBackend for Sqlite {
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
    fn is_missing_table(error: &sqlx::Error, table: &Table) -> bool {
        error
            .as_database_error()
            .is_some_and(|error| no_such_table(error.code().as_deref(), error.message(), table))
    }

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

    /// An embedded database is never away: its failures are the message's or the disk's.
    fn is_unavailable_link(_: &dyn DatabaseError) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::{Table, Violation, no_such_table, parse_violation};

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

    #[test]
    fn no_such_table_names_this_table() {
        let table = Table::new("processed_messages").unwrap();
        let qualified = Table::new("main.processed_messages").unwrap();
        let message = "no such table: processed_messages";
        assert!(no_such_table(Some("1"), message, &table));
        assert!(!no_such_table(Some("1"), message, &qualified));
        assert!(no_such_table(
            Some("1"),
            "no such table: main.processed_messages",
            &qualified
        ));
        // Another table (a trigger's), another code, another message.
        assert!(!no_such_table(
            Some("1"),
            "no such table: audit_log",
            &table
        ));
        assert!(!no_such_table(Some("5"), message, &table));
        assert!(!no_such_table(
            Some("1"),
            "no such column: processed_at",
            &table
        ));
        assert!(!no_such_table(None, message, &table));
    }
}
