//! PostgreSQL: SQLSTATEs, and the constraint name in the error's own field.

use std::error::Error as StdError;

use sqlx::Postgres;
use sqlx::error::DatabaseError;
use sqlx::postgres::{PgConnection, PgDatabaseError};

use super::{ClassifyBackend, Violation};
use crate::table::Table;

/// serialization_failure, deadlock_detected, lock_not_available (lock_timeout).
const TRANSIENT: [&str; 3] = ["40001", "40P01", "55P03"];

const UNIQUE_VIOLATION: &str = "23505";

/// undefined_table.
const UNDEFINED_TABLE: &str = "42P01";

impl ClassifyBackend for Postgres {
    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool {
        error
            .downcast_ref::<PgDatabaseError>()
            .is_some_and(|error| TRANSIENT.contains(&error.code()))
    }

    fn is_unavailable_link(error: &dyn DatabaseError) -> bool {
        super::unavailable_sqlstate(error)
    }

    /// SQLSTATE 23505 (unique_violation) carries the constraint's name in its own field.
    fn unique_violation_link(error: &(dyn StdError + 'static)) -> Option<Violation> {
        let error = error.downcast_ref::<PgDatabaseError>()?;
        if error.code() != UNIQUE_VIOLATION {
            return None;
        }
        error
            .constraint()
            .map(|name| Violation::Named(name.to_owned()))
    }

    fn is_missing_table(error: &sqlx::Error, _: &Table) -> bool {
        error
            .as_database_error()
            .and_then(|error| error.try_downcast_ref::<PgDatabaseError>())
            .is_some_and(|error| error.code() == UNDEFINED_TABLE)
    }

    async fn matching(
        _: &mut PgConnection,
        violation: Violation,
        names: &'static [&'static str],
    ) -> Option<&'static str> {
        super::matching_name(&violation, names)
    }
}
