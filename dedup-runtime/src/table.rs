//! Table names, checked once: [`Table`]. A ground-floor file: it imports nothing of this
//! crate but its limits.

use std::fmt;

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
