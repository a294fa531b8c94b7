//! Creating the dedup table: `migrate` for the default name, `migrate_table` for others,
//! `schema_sql` for your own migration tool. The DDL itself is in `schema/`.

use sqlx::Pool;

use crate::backend::Backend;
use crate::schema::{DEFAULT_TABLE, InvalidTableName, Table};

/// Creates the default dedup table, `processed_messages`, and its pruning index, if they
/// do not exist yet. Safe to call at every start and from several processes at once.
///
/// The same SQL ships as files to copy into your own migrations, in this crate's package
/// and [in the repository][migrations]:
/// `migrations/{postgres,mysql,sqlite}/0001_processed_messages.sql`; [`schema_sql`]
/// prints it for any table name.
///
/// [migrations]: https://github.com/dedup-rs/dedup/tree/main/dedup-runtime/migrations
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// dedup_runtime::migrate(&pool).await?;
/// dedup_runtime::migrate(&pool).await?; // idempotent
/// # Ok(()) }
/// ```
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    let table = Table::new(DEFAULT_TABLE).map_err(sqlx::Error::config)?;
    DB::create(pool, DB::ddl(&table)).await
}

/// Like [`migrate`], for a handler declared with `table = "…"`.
///
/// An invalid name is refused before anything runs, with an [`InvalidTableName`] inside
/// [`sqlx::Error::Configuration`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// // For handlers declared `#[idempotent(table = "audit_processed", …)]`:
/// dedup_runtime::migrate_table(&pool, "audit_processed").await?;
///
/// let refused = dedup_runtime::migrate_table(&pool, "audit; DROP TABLE users").await;
/// assert!(matches!(refused, Err(sqlx::Error::Configuration(_))));
/// # Ok(()) }
/// ```
pub async fn migrate_table<DB: Backend>(pool: &Pool<DB>, table: &str) -> Result<(), sqlx::Error> {
    let table = Table::new(table).map_err(sqlx::Error::config)?;
    DB::create(pool, DB::ddl(&table)).await
}

/// The SQL that [`migrate_table`] runs for `table` on `DB`, as one script to paste into
/// your own migrations.
///
/// ```
/// let sql = dedup_runtime::schema_sql::<sqlx::Sqlite>("processed_messages").unwrap();
/// assert!(sql.starts_with("CREATE TABLE IF NOT EXISTS processed_messages"));
/// ```
pub fn schema_sql<DB: Backend>(table: &str) -> Result<String, InvalidTableName> {
    let table = Table::new(table)?;
    Ok(DB::ddl(&table)
        .into_iter()
        .map(|statement| statement + ";\n")
        .collect())
}
