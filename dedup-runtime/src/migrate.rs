//! Creating the dedup table: `migrate` for the default name, `migrate_table` for others.

use std::fmt;

use sqlx::Pool;

use crate::backend::Backend;

/// The default dedup table, used when `#[idempotent]` has no `table = "…"`.
pub const DEFAULT_TABLE: &str = "processed_messages";

/// The longest table or schema name every backend accepts (PostgreSQL's limit).
pub const MAX_TABLE_NAME_LEN: usize = 63;

/// A validated dedup table name: `name` or `schema.name`, each a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    name: String,
    dot: Option<usize>,
}

impl Table {
    /// Checks `name` the way `#[idempotent(table = "…")]` does at compile time.
    ///
    /// ```
    /// use dedup_runtime::Table;
    ///
    /// assert!(Table::new("audit.processed_messages").is_ok());
    /// assert!(Table::new("processed_messages; DROP TABLE users").is_err());
    /// ```
    pub fn new(name: &str) -> Result<Table, InvalidTableName> {
        let plain = |part: &str| {
            let mut chars = part.chars();
            matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
                && part.len() <= MAX_TABLE_NAME_LEN
        };
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|part| plain(part)) {
            return Err(InvalidTableName {
                name: name.to_owned(),
            });
        }
        Ok(Table {
            name: name.to_owned(),
            dot: name.find('.'),
        })
    }

    /// The name as written, possibly schema-qualified.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The schema, when the name is qualified.
    pub fn schema(&self) -> Option<&str> {
        self.dot.map(|dot| &self.name[..dot])
    }

    /// The unqualified table name.
    pub fn base(&self) -> &str {
        self.dot.map_or(&self.name, |dot| &self.name[dot + 1..])
    }
}

/// A table name that is not a plain SQL identifier (optionally `schema.`-qualified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTableName {
    name: String,
}

impl fmt::Display for InvalidTableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid dedup table name {:?}: expected a plain SQL identifier (letters, digits, \
             `_`, at most {MAX_TABLE_NAME_LEN} characters), optionally `schema.`-qualified",
            self.name
        )
    }
}

impl std::error::Error for InvalidTableName {}

/// Creates the default dedup table, `processed_messages`, and its pruning index, if they
/// do not exist yet. Safe to call at every start and from several processes at once.
///
/// The same SQL ships as files to copy into your own migrations:
/// `dedup-runtime/migrations/{postgres,mysql,sqlite}/0001_processed_messages.sql`, and
/// [`schema_sql`] prints it for any table name.
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
