//! MySQL and MariaDB: `VARBINARY` ids (byte order), `processed_at` in UTC.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, Connection, MySql, Pool};

use super::{ADDED_COLUMNS, SchemaBackend};
use crate::table::Table;

/// Serialises concurrent `migrate` calls (a named lock: `GET_LOCK`), so that two of them
/// never both find a column missing and both add it.
const MIGRATE_LOCK: &str = "dedup_runtime.migrate";

/// How long a `migrate` waits for another one's lock, in seconds.
const MIGRATE_LOCK_WAIT: i32 = 120;

/// The columns of migration `0002`, as `CREATE TABLE` and `ADD COLUMN` both write them, in order. Nullable,
/// no default: on MariaDB 10.11 adding them is `ALGORITHM=INSTANT` (no copy, no rebuild;
/// checked by `tests/suite/upgrade.rs`). `expires_at` is UTC, like `processed_at`.
///
/// Then the columns of migration `0005`, what the row remembers of the delivery that processed it
/// (`crate::stored`): `LONGBLOB` holds every result `MAX_RESULT_LEN` allows (a
/// `MEDIUMBLOB`'s 16 MiB would too, but with `sql_mode = ''` an over-long value is cut,
/// not refused: nothing may come near a column's end), the fingerprint always 32 bytes.
const COLUMNS: [&str; 6] = [
    "state        TINYINT NULL CHECK (state IN (1, 2))",
    "owner        BINARY(16) NULL",
    "expires_at   DATETIME(6) NULL",
    "result         LONGBLOB NULL",
    "result_version INT NULL",
    "fingerprint    BINARY(32) NULL",
];

fn create_table(table: &Table) -> String {
    // VARBINARY: ids compare byte for byte, with no case folding and no PAD SPACE
    // (`a` and `a ` are different messages). `processed_at` is UTC whatever the
    // sessions' time zones (the claim and the commit write `UTC_TIMESTAMP(6)`, pruning
    // compares with it). No index on `state`: MySQL has no partial index, and every plain
    // claim would pay for a full one; listing the rows not processed scans the table.
    let [
        state,
        owner,
        expires_at,
        result,
        result_version,
        fingerprint,
    ] = COLUMNS;
    format!(
        "CREATE TABLE IF NOT EXISTS {name} (\n    \
         consumer     VARBINARY(255) NOT NULL,\n    \
         message_id   VARBINARY(255) NOT NULL,\n    \
         processed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
         {state},\n    \
         {owner},\n    \
         {expires_at},\n    \
         {result},\n    \
         {result_version},\n    \
         {fingerprint},\n    \
         PRIMARY KEY (consumer, message_id),\n    \
         KEY processed_at_idx (processed_at)\n\
         ) ENGINE = InnoDB",
        name = table.name()
    )
}

/// Upgrades a table created with the session-zone default of earlier versions (metadata
/// only, idempotent).
fn utc_default(table: &Table) -> String {
    format!(
        "ALTER TABLE {} ALTER COLUMN processed_at SET DEFAULT (UTC_TIMESTAMP(6))",
        table.name()
    )
}

/// Whether `processed_at` of `table` defaults to `UTC_TIMESTAMP(6)` already (MariaDB and
/// MySQL 8 show it as `utc_timestamp(6)`; a table of the session-zone default, as
/// `current_timestamp(6)`).
async fn utc_by_default(conn: &mut MySqlConnection, table: &Table) -> Result<bool, sqlx::Error> {
    let column = column_of(conn, table, "processed_at").await?;
    Ok(column
        .and_then(|column| column.default)
        .is_some_and(|default| default.to_ascii_lowercase().contains("utc_timestamp")))
}

/// What the catalog says of one column of a table.
struct Column {
    data_type: String,
    default: Option<String>,
}

/// `column` of `table` as the catalog has it; `None` when there is no such column.
async fn column_of<'e>(
    executor: impl sqlx::Executor<'e, Database = MySql>,
    table: &Table,
    column: &str,
) -> Result<Option<Column>, sqlx::Error> {
    let found: Option<(String, Option<String>)> = sqlx::query_as(
        "SELECT CAST(DATA_TYPE AS CHAR), CAST(COLUMN_DEFAULT AS CHAR) \
         FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ? AND COLUMN_NAME = ?",
    )
    .bind(table.schema())
    .bind(table.base())
    .bind(column)
    .fetch_optional(executor)
    .await?;
    Ok(found.map(|(data_type, default)| Column { data_type, default }))
}

/// `ALTER TABLE … ADD COLUMN` for `columns` (from [`COLUMNS`]), each with `if_not_exists`
/// (MariaDB's `IF NOT EXISTS `, or nothing).
fn add_columns<'a>(
    table: &Table,
    columns: impl Iterator<Item = &'a str>,
    if_not_exists: &str,
) -> String {
    let adds: Vec<String> = columns
        .map(|column| format!("\n    ADD COLUMN {if_not_exists}{column}"))
        .collect();
    format!("ALTER TABLE {}{}", table.name(), adds.join(","))
}

impl SchemaBackend for MySql {
    fn ddl(table: &Table) -> Vec<String> {
        vec![create_table(table), utc_default(table)]
    }

    fn upgrade_ddl(table: &Table) -> Vec<String> {
        // Migration `0002`'s columns, then `0005`'s, as the shipped files have them.
        let (state, results) = COLUMNS.split_at(3);
        vec![
            add_columns(table, state.iter().copied(), "IF NOT EXISTS "),
            add_columns(table, results.iter().copied(), "IF NOT EXISTS "),
        ]
    }

    async fn create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        // MySQL DDL commits implicitly, so there is no transaction to hold: a named lock
        // serialises migrations instead. On a connection of its own, out of the pool: if
        // this future is dropped, closing the connection releases the lock (a pooled one
        // would keep it). MySQL 8 has no `ADD COLUMN IF NOT EXISTS`, so the catalog says
        // which columns are missing, and the `ALTER` adds those (on both).
        let mut conn = pool.acquire().await?.detach();
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(MIGRATE_LOCK)
            .bind(MIGRATE_LOCK_WAIT)
            .fetch_one(&mut conn)
            .await?;
        if locked != Some(1) {
            return Err(sqlx::Error::Protocol(format!(
                "migrate: another `migrate` held the lock `{MIGRATE_LOCK}` for over \
                 {MIGRATE_LOCK_WAIT} s"
            )));
        }
        // Only what is missing: every `ALTER TABLE`, even one that changes nothing, waits
        // for an exclusive metadata lock behind every open transaction on the table, and
        // every claim after it waits behind the `ALTER` (a service starting beside others
        // would stall them all; a handler waiting on another would never be let go). A
        // table already right is only looked at.
        let mut present = columns_of(&mut conn, table).await?;
        if present.is_empty() {
            sqlx::raw_sql(AssertSqlSafe(create_table(table)))
                .execute(&mut conn)
                .await?;
            present = columns_of(&mut conn, table).await?;
        } else if !utc_by_default(&mut conn, table).await? {
            sqlx::raw_sql(AssertSqlSafe(utc_default(table)))
                .execute(&mut conn)
                .await?;
        }
        let missing: Vec<&str> = ADDED_COLUMNS
            .iter()
            .zip(COLUMNS)
            .filter(|(name, _)| !present.iter().any(|column| column == *name))
            .map(|(_, column)| column)
            .collect();
        if !missing.is_empty() {
            sqlx::raw_sql(AssertSqlSafe(add_columns(table, missing.into_iter(), "")))
                .execute(&mut conn)
                .await?;
        }
        conn.close().await
    }
}

/// Runs `statements` under the named lock `migrate` takes (MySQL DDL commits implicitly:
/// there is no transaction to hold), on a connection of its own that closing releases:
/// the DDL of the tables beside the dedup table (the inbox's, the outbox's).
pub(crate) async fn create_locked(
    pool: &Pool<MySql>,
    statements: Vec<String>,
) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?.detach();
    let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
        .bind(MIGRATE_LOCK)
        .bind(MIGRATE_LOCK_WAIT)
        .fetch_one(&mut conn)
        .await?;
    if locked != Some(1) {
        return Err(sqlx::Error::Protocol(format!(
            "migrate: another `migrate` held the lock `{MIGRATE_LOCK}` for over \
             {MIGRATE_LOCK_WAIT} s"
        )));
    }
    for statement in statements {
        sqlx::raw_sql(AssertSqlSafe(statement))
            .execute(&mut conn)
            .await?;
    }
    conn.close().await
}

/// An inbox or outbox table made before its `headers` column became `MEDIUMBLOB`: a
/// `BLOB` holds 65,535 bytes, one less than `MAX_HEADERS_LEN` (on a strict server the
/// insert failed with 1406; with `sql_mode = ''` the last byte was cut). Widened once;
/// a table already right is only looked at.
pub(crate) async fn widen_headers(pool: &Pool<MySql>, table: &Table) -> Result<(), sqlx::Error> {
    let name = table.name();
    let headers = column_of(pool, table, "headers").await?;
    if headers.is_some_and(|headers| headers.data_type.eq_ignore_ascii_case("blob")) {
        create_locked(
            pool,
            vec![format!("ALTER TABLE {name} MODIFY headers MEDIUMBLOB NULL")],
        )
        .await?;
    }
    Ok(())
}

/// Adds `column` (`definition`) to `table` if it lacks it (a table made before the column
/// was): MySQL 8 has no `ADD COLUMN IF NOT EXISTS`, so the catalog says. A table already
/// right is only looked at.
pub(crate) async fn add_missing(
    pool: &Pool<MySql>,
    table: &Table,
    column: &str,
    definition: &str,
) -> Result<(), sqlx::Error> {
    if !columns_of(pool, table)
        .await?
        .iter()
        .any(|present| present == column)
    {
        let added = format!("{column} {definition}");
        let alter = add_columns(table, std::iter::once(added.as_str()), "");
        match create_locked(pool, vec![alter]).await {
            // Another process added it between the look and the change.
            Err(error) if crate::dialect::mysql::error_number(&error) == Some(DUP_FIELDNAME) => {}
            other => other?,
        }
    }
    Ok(())
}

/// The columns `table` has, from the catalog (MySQL 8 has no `ADD COLUMN IF NOT EXISTS`).
async fn columns_of<'e>(
    executor: impl sqlx::Executor<'e, Database = MySql>,
    table: &Table,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
         WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?",
    )
    .bind(table.schema())
    .bind(table.base())
    .fetch_all(executor)
    .await
}

/// `ER_DUP_FIELDNAME`: the column is there already.
const DUP_FIELDNAME: u16 = 1060;
