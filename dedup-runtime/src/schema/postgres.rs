//! PostgreSQL: `text COLLATE "C"` ids (byte order), an advisory lock around the DDL.

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Pool, Postgres};

use super::{ADDED_COLUMNS, SchemaBackend};
use crate::table::Table;

/// Serialises concurrent `migrate` calls: `CREATE … IF NOT EXISTS` alone races on the
/// catalog's unique indexes. The number is arbitrary and stable ("dedup" + 1).
const MIGRATE_LOCK: i64 = 0x6465_6475_7000_0001;

/// The columns of migration `0002`, as `CREATE TABLE` and `ADD COLUMN` both write them. No default: adding
/// them is a catalog change, no row is rewritten. The inline `CHECK` is named
/// `<table>_state_check` either way.
const STATE: &str = "state        smallint CHECK (state IN (1, 2))";
const OWNER: &str = "owner        bytea";
const EXPIRES_AT: &str = "expires_at   timestamptz";
/// The columns of migration `0005`: what the row remembers of the delivery that processed it (a stored
/// result, its version, the payload's fingerprint; `crate::stored`). Nullable, no default:
/// a catalog change.
const RESULT: &str = "result         bytea";
const RESULT_VERSION: &str = "result_version integer";
const FINGERPRINT: &str = "fingerprint    bytea";

fn create_table(table: &Table) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {name} (\n    \
         consumer     text COLLATE \"C\" NOT NULL,\n    \
         message_id   text COLLATE \"C\" NOT NULL,\n    \
         processed_at timestamptz NOT NULL DEFAULT now(),\n    \
         {STATE},\n    \
         {OWNER},\n    \
         {EXPIRES_AT},\n    \
         {RESULT},\n    \
         {RESULT_VERSION},\n    \
         {FINGERPRINT},\n    \
         PRIMARY KEY (consumer, message_id)\n)",
        name = table.name()
    )
}

fn add_columns(table: &Table) -> String {
    format!(
        "ALTER TABLE {}\n    \
         ADD COLUMN IF NOT EXISTS {STATE},\n    \
         ADD COLUMN IF NOT EXISTS {OWNER},\n    \
         ADD COLUMN IF NOT EXISTS {EXPIRES_AT}",
        table.name()
    )
}

fn add_result_columns(table: &Table) -> String {
    format!(
        "ALTER TABLE {}\n    \
         ADD COLUMN IF NOT EXISTS {RESULT},\n    \
         ADD COLUMN IF NOT EXISTS {RESULT_VERSION},\n    \
         ADD COLUMN IF NOT EXISTS {FINGERPRINT}",
        table.name()
    )
}

fn processed_at_index(table: &Table) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {}_processed_at_idx ON {} (processed_at)",
        table.base(),
        table.name()
    )
}

/// The rows not processed (in progress, outcome unknown), per consumer. Partial: a plain
/// claim (`state` NULL) never enters it, so it costs the hot path nothing.
fn unresolved_index(table: &Table) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {}_unresolved_idx ON {} (consumer, state, expires_at) \
         WHERE state IS NOT NULL",
        table.base(),
        table.name()
    )
}

/// The index's name as `to_regclass` finds it: in the table's schema.
fn unresolved_index_name(table: &Table) -> String {
    qualified(table, &format!("{}_unresolved_idx", table.base()))
}

/// `name` (an index of `table`) as `to_regclass` finds it: in the table's schema.
fn qualified(table: &Table, name: &str) -> String {
    match table.schema() {
        Some(schema) => format!("{schema}.{name}"),
        None => name.to_owned(),
    }
}

/// Whether the relation `name` (schema-qualified where needed) exists; takes no lock.
async fn exists(conn: &mut PgConnection, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(conn)
        .await
}

/// The index a statement of ours creates, `CREATE INDEX IF NOT EXISTS <name> ON …`.
fn index_created(statement: &str) -> Option<&str> {
    statement
        .strip_prefix("CREATE INDEX IF NOT EXISTS ")?
        .split_whitespace()
        .next()
}

impl SchemaBackend for Postgres {
    fn ddl(table: &Table) -> Vec<String> {
        vec![
            create_table(table),
            processed_at_index(table),
            unresolved_index(table),
        ]
    }

    fn upgrade_ddl(table: &Table) -> Vec<String> {
        vec![
            add_columns(table),
            unresolved_index(table),
            add_result_columns(table),
        ]
    }

    async fn create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        // One transaction under the advisory lock: a concurrent `migrate` waits for it and
        // then finds everything in place. The upgrade's statements run only when the
        // catalog lacks what they add, because `ALTER TABLE` and `CREATE INDEX` lock the
        // table (`ACCESS EXCLUSIVE`, `SHARE`) even when there is nothing to do, and every
        // service start calls `migrate` while other instances' consumers are writing.
        // When they do run (once per table), consumers wait for this transaction: adding
        // the columns is a catalog change, but PostgreSQL checks the new `CHECK` against
        // every row and builds the partial index with one scan of the table.
        let mut tx = begin_quiet_locked(pool).await?;
        sqlx::raw_sql(AssertSqlSafe(create_table(table)))
            .execute(&mut *tx)
            .await?;
        let present: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_attribute \
             WHERE attrelid = to_regclass($1) AND attname = ANY($2) AND NOT attisdropped",
        )
        .bind(table.name())
        .bind(&ADDED_COLUMNS[..])
        .fetch_one(&mut *tx)
        .await?;
        if present < ADDED_COLUMNS.len() as i64 {
            for add in [add_columns(table), add_result_columns(table)] {
                sqlx::raw_sql(AssertSqlSafe(add)).execute(&mut *tx).await?;
            }
        }
        // `CREATE INDEX IF NOT EXISTS` takes its `SHARE` lock before it looks: it would
        // wait for every open handler's transaction, and every claim after it for it.
        if !exists(
            &mut tx,
            &qualified(table, &format!("{}_processed_at_idx", table.base())),
        )
        .await?
        {
            sqlx::raw_sql(AssertSqlSafe(processed_at_index(table)))
                .execute(&mut *tx)
                .await?;
        }
        if !exists(&mut tx, &unresolved_index_name(table)).await? {
            sqlx::raw_sql(AssertSqlSafe(unresolved_index(table)))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        mark_upgraded(table.name());
        Ok(())
    }
}

/// Begins a migration's transaction: under the advisory lock every `migrate` takes, and
/// with the server's notices below a warning off for the transaction (`SET LOCAL`), so
/// that `CREATE TABLE IF NOT EXISTS` on a table that exists does not say "relation …
/// already exists, skipping", which sqlx logs at INFO: a `migrate` at every start with
/// nothing to do logs nothing.
pub(crate) async fn begin_quiet_locked(
    pool: &Pool<Postgres>,
) -> Result<sqlx::Transaction<'static, Postgres>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "SELECT set_config('client_min_messages', 'warning', true), pg_advisory_xact_lock($1)",
    )
    .bind(MIGRATE_LOCK)
    .execute(&mut *tx)
    .await?;
    Ok(tx)
}

/// Runs `statements` in one transaction under the advisory lock `migrate` takes: the DDL
/// of the tables beside the dedup table (the inbox's, the outbox's), `table`'s. A
/// concurrent migration waits, then finds everything in place. An index that exists is
/// not created again: `CREATE INDEX IF NOT EXISTS` takes its `SHARE` lock before it
/// looks, so it would wait for every open transaction that wrote to the table, and every
/// writer after it for it (`CREATE TABLE IF NOT EXISTS` takes no lock on a table that
/// exists).
pub(crate) async fn create_locked(
    pool: &Pool<Postgres>,
    table: &Table,
    statements: Vec<String>,
) -> Result<(), sqlx::Error> {
    let mut tx = begin_quiet_locked(pool).await?;
    for statement in statements {
        if let Some(index) = index_created(&statement)
            && exists(&mut tx, &qualified(table, index)).await?
        {
            continue;
        }
        sqlx::raw_sql(AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

/// The dedup tables this process knows to have the columns of migration `0002` (`state`, `expires_at`),
/// and those it last found without them (looked at again after [`RECHECK`]).
static UPGRADED: std::sync::Mutex<Vec<(String, bool, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// How long a table found without the columns of migration `0002` is taken for one (until `migrate`
/// upgrades it: then this process's `migrate` says so at once).
const RECHECK: std::time::Duration = std::time::Duration::from_secs(60);

/// `table` has the columns of migration `0002`: `migrate` made sure of it.
pub(crate) fn mark_upgraded(table: &str) {
    remember_upgraded(table, true);
}

fn remember_upgraded(table: &str, upgraded: bool) {
    let mut known = UPGRADED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let now = std::time::Instant::now();
    match known.iter_mut().find(|(name, ..)| name == table) {
        Some(entry) => *entry = (table.to_owned(), upgraded, now),
        None => known.push((table.to_owned(), upgraded, now)),
    }
}

/// Whether the dedup table `table` has the columns of migration `0002`, so that a claim reads `state` and
/// `expires_at` by name: from this process's memory, else from the catalog (on `conn`,
/// once per table, and again a minute after a table was found without them). Claims of
/// a table of migration `0001` read them through the row's JSON instead — which converts the whole
/// row, a stored result included (9 ms for 1 MB, measured): named columns keep a
/// duplicate's claim at the cost of its row's two columns.
pub(crate) async fn upgraded(
    conn: &mut sqlx::PgConnection,
    table: &str,
) -> Result<bool, sqlx::Error> {
    {
        let known = UPGRADED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, upgraded, at)) = known.iter().find(|(name, ..)| name == table)
            && (*upgraded || at.elapsed() < RECHECK)
        {
            return Ok(*upgraded);
        }
    }
    let upgraded = has_column(conn, table, "expires_at").await?;
    remember_upgraded(table, upgraded);
    Ok(upgraded)
}

/// Whether the table `table` (as the session's `search_path` resolves it) has `column`,
/// from the catalog.
async fn has_column<'e>(
    executor: impl sqlx::Executor<'e, Database = Postgres>,
    table: &str,
    column: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute \
         WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped)",
    )
    .bind(table)
    .bind(column)
    .fetch_one(executor)
    .await
}

/// Adds `column` (`definition`) to `table` if the catalog says it lacks it (a table made
/// before the column was). Looked up first, because `ALTER TABLE … ADD COLUMN IF NOT
/// EXISTS` takes an `ACCESS EXCLUSIVE` lock even when the column is there: run at every
/// `migrate`, after the `CREATE INDEX IF NOT EXISTS` of the same transaction (a `SHARE`
/// lock), it waited for every writer and deadlocked with those that went on writing. A
/// table already right is only looked at; a missing column is added in a transaction of
/// its own, under the migrations' lock.
pub(crate) async fn add_missing(
    pool: &Pool<Postgres>,
    table: &Table,
    column: &str,
    definition: &str,
) -> Result<(), sqlx::Error> {
    if has_column(pool, table.name(), column).await? {
        return Ok(());
    }
    let alter = format!(
        "ALTER TABLE {} ADD COLUMN IF NOT EXISTS {column} {definition}",
        table.name()
    );
    create_locked(pool, table, vec![alter]).await
}
