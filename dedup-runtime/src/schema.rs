//! The dedup table: its name ([`Table`]) and each backend's DDL ([`SchemaBackend`], one
//! file per backend). `migrate.rs` runs it; `prune.rs` deletes from the table.

use std::fmt;
use std::future::Future;

use sqlx::{Database, Pool};

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

/// How one backend creates the dedup table, and upgrades one that an earlier version
/// created.
///
/// The table's columns, on every backend: `consumer`, `message_id`, `processed_at` (0.1),
/// then `state`, `owner` and `expires_at` (0.2, for claims that are not processed yet:
/// marks and leases). A plain handler's claim writes none of the three: `state` NULL means
/// processed. `1` is in progress (held by `owner`, a 16-byte fencing token, until
/// `expires_at` on the database's clock), `2` is outcome unknown (an operator resolves
/// it). The three are nullable and have no default, so that adding them to a 0.1 table
/// changes no row.
pub trait SchemaBackend: Database {
    /// The statements that create `table` complete and current (its columns, its pruning
    /// index, its index of rows not processed), when it does not exist yet.
    #[doc(hidden)]
    fn ddl(table: &Table) -> Vec<String>;

    /// The statements that upgrade a 0.1 table (`consumer`, `message_id`, `processed_at`)
    /// to the current columns and indexes: the `0002` files, for users' own migration
    /// tools. `create` does the same, checking the catalog first.
    #[doc(hidden)]
    fn upgrade_ddl(table: &Table) -> Vec<String>;

    /// Creates `table`, or upgrades it in place, so that concurrent migrations (and
    /// consumers writing to the table) do not trip over each other.
    #[doc(hidden)]
    fn create<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// The columns 0.2 adds to a 0.1 table, in the order they are added.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
const ADDED_COLUMNS: [&str; 6] = [
    "state",
    "owner",
    "expires_at",
    "result",
    "result_version",
    "fingerprint",
];

/// The default dedup table, used when `#[idempotent]` has no `table = "…"`.
pub const DEFAULT_TABLE: &str = "processed_messages";

/// The longest table or schema name every backend accepts (PostgreSQL's limit).
pub const MAX_TABLE_NAME_LEN: usize = dedup_limits::MAX_TABLE_NAME_LEN;

/// A validated dedup table name: `name` or `schema.name`, each a plain SQL identifier.
///
/// ```
/// use dedup_runtime::Table;
///
/// let table = Table::new("audit.processed_messages")?;
/// assert_eq!(table.name(), "audit.processed_messages");
/// assert_eq!((table.schema(), table.base()), (Some("audit"), "processed_messages"));
/// assert_eq!(Table::new("processed_messages")?.schema(), None);
/// # Ok::<(), dedup_runtime::InvalidTableName>(())
/// ```
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
        if !dedup_limits::is_table_name(name) {
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
///
/// ```
/// let error = dedup_runtime::Table::new("processed messages").unwrap_err();
/// assert!(error.to_string().starts_with(r#"invalid dedup table name "processed messages""#));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTableName {
    name: String,
}

/// The name, as given.
impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// Compares the name: `table == "audit.processed_messages"`.
impl PartialEq<str> for Table {
    fn eq(&self, other: &str) -> bool {
        self.name == other
    }
}

impl PartialEq<&str> for Table {
    fn eq(&self, other: &&str) -> bool {
        self.name == *other
    }
}

impl PartialEq<String> for Table {
    fn eq(&self, other: &String) -> bool {
        &self.name == other
    }
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
