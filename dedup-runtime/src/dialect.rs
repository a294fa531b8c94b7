//! Each backend's SQL dialect as the concerns share it: placeholders, the database's now,
//! transaction openers, error numbers. A ground-floor folder: it imports nothing of this
//! crate but table names.

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
