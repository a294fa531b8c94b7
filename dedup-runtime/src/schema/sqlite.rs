//! SQLite: a `WITHOUT ROWID` table, its `processed_at` as ISO 8601 text in UTC.

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::{ADDED_COLUMNS, SchemaBackend};
use crate::dialect::sqlite::BEGIN;
use crate::table::Table;

/// The columns of migration `0002`, as `CREATE TABLE` and `ADD COLUMN` both write them, in order.
/// `expires_at` is text in `processed_at`'s format (`%Y-%m-%dT%H:%M:%fZ`, UTC), so that
/// comparing the two, or either with the clock written the same way, compares times.
///
/// Then the columns of migration `0005`, what the row remembers of the delivery that processed it
/// (`crate::stored`).
const COLUMNS: [&str; 6] = [
    "state        INTEGER CHECK (state IN (1, 2))",
    "owner        BLOB",
    "expires_at   TEXT",
    "result         BLOB",
    "result_version INTEGER",
    "fingerprint    BLOB",
];

fn create_table(table: &Table) -> String {
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
         consumer     TEXT NOT NULL,\n    \
         message_id   TEXT NOT NULL,\n    \
         processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),\n    \
         {state},\n    \
         {owner},\n    \
         {expires_at},\n    \
         {result},\n    \
         {result_version},\n    \
         {fingerprint},\n    \
         PRIMARY KEY (consumer, message_id)\n\
         ) WITHOUT ROWID",
        name = table.name()
    )
}

/// The columns `table` has, from `pragma_table_info` (SQLite has no `ADD COLUMN IF NOT
/// EXISTS`): in the caller's write transaction, so that adding what it lacks cannot race.
async fn columns_of(
    conn: &mut sqlx::SqliteConnection,
    table: &Table,
) -> Result<Vec<String>, sqlx::Error> {
    match table.schema() {
        Some(schema) => {
            sqlx::query_scalar("SELECT name FROM pragma_table_info(?1, ?2)")
                .bind(table.base())
                .bind(schema)
                .fetch_all(conn)
                .await
        }
        None => {
            sqlx::query_scalar("SELECT name FROM pragma_table_info(?1)")
                .bind(table.base())
                .fetch_all(conn)
                .await
        }
    }
}

fn add_column(table: &Table, column: &str) -> String {
    format!("ALTER TABLE {} ADD COLUMN {column}", table.name())
}

/// An index of `table` named `<table>_<suffix>`: SQLite wants the schema on the index's
/// name, and the table's unqualified.
fn index(table: &Table, suffix: &str, rest: &str) -> String {
    let index = match table.schema() {
        Some(schema) => format!("{schema}.{}_{suffix}", table.base()),
        None => format!("{}_{suffix}", table.base()),
    };
    format!(
        "CREATE INDEX IF NOT EXISTS {index} ON {} {rest}",
        table.base()
    )
}

fn indexes(table: &Table) -> [String; 2] {
    [
        index(table, "processed_at_idx", "(processed_at)"),
        // The rows not processed (in progress, outcome unknown), per consumer. Partial: a
        // plain claim (`state` NULL) never enters it, so it costs the hot path nothing.
        index(
            table,
            "unresolved_idx",
            "(consumer, state, expires_at) WHERE state IS NOT NULL",
        ),
    ]
}

impl SchemaBackend for Sqlite {
    fn ddl(table: &Table) -> Vec<String> {
        let mut ddl = vec![create_table(table)];
        ddl.extend(indexes(table));
        ddl
    }

    fn upgrade_ddl(table: &Table) -> Vec<String> {
        // SQLite has no `ADD COLUMN IF NOT EXISTS`: run once (as migration tools do), or
        // let `migrate` check the catalog first.
        // Migration `0002`'s columns and index, then `0005`'s columns, as the shipped files have them.
        let (state, results) = COLUMNS.split_at(3);
        let mut ddl: Vec<String> = state
            .iter()
            .map(|column| add_column(table, column))
            .collect();
        ddl.push(indexes(table)[1].clone());
        ddl.extend(results.iter().map(|column| add_column(table, column)));
        ddl
    }

    async fn create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        // Everything in one `BEGIN IMMEDIATE` transaction: it holds the write lock from
        // the start, so a concurrent `migrate` (or a consumer) waits for it (busy
        // timeout), then finds the columns in place; reading `pragma_table_info` and
        // adding what it lacks cannot race. Adding a column rewrites no row (SQLite
        // checks the `CHECK` against each, one scan).
        let mut tx = pool.begin_with(BEGIN).await?;
        sqlx::raw_sql(AssertSqlSafe(create_table(table)))
            .execute(&mut *tx)
            .await?;
        let present = columns_of(&mut tx, table).await?;
        for (name, column) in ADDED_COLUMNS.iter().zip(COLUMNS) {
            if !present.iter().any(|present| present == name) {
                sqlx::raw_sql(AssertSqlSafe(add_column(table, column)))
                    .execute(&mut *tx)
                    .await?;
            }
        }
        for statement in indexes(table) {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }
}

/// Runs `statements` in one `BEGIN IMMEDIATE` transaction (a concurrent migration waits
/// for the write lock, then finds everything in place): the DDL of the tables beside the
/// dedup table (the inbox's, the outbox's).
pub(crate) async fn create_locked(
    pool: &Pool<Sqlite>,
    statements: Vec<String>,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin_with(BEGIN).await?;
    for statement in statements {
        sqlx::raw_sql(AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

/// Adds `column` (`definition`) to `table` if it lacks it (a table made before the column
/// was): SQLite has no `ADD COLUMN IF NOT EXISTS`, so `pragma_table_info` says, in the
/// same write transaction as the change.
pub(crate) async fn add_missing(
    pool: &Pool<Sqlite>,
    table: &Table,
    column: &str,
    definition: &str,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin_with(BEGIN).await?;
    if !columns_of(&mut tx, table)
        .await?
        .iter()
        .any(|present| present == column)
    {
        sqlx::raw_sql(AssertSqlSafe(add_column(
            table,
            &format!("{column} {definition}"),
        )))
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
}
