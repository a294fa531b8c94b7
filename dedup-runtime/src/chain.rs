//! The one walk along an error's chain of sources, for every classification: transient
//! failures, unique violations, unavailable databases, invalid message ids.

use std::error::Error as StdError;

use sqlx::error::DatabaseError;

/// The first `Some` that `look` finds in `error`'s chain of sources. `look` sees each
/// link, and the database error it carries, if any: a `sqlx::Error::Database`, or the
/// boxed `DatabaseError` that `#[error(transparent)]` wrappers forward `source()` to (its
/// concrete type is the box itself).
pub(crate) fn find<'e, T>(
    error: &'e (dyn StdError + 'static),
    look: impl Fn(&'e (dyn StdError + 'static), Option<&'e dyn DatabaseError>) -> Option<T>,
) -> Option<T> {
    let mut link = Some(error);
    while let Some(error) = link {
        let database = match error.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Database(database)) => Some(&**database),
            _ => error
                .downcast_ref::<Box<dyn DatabaseError>>()
                .map(|database| &**database),
        };
        if let Some(found) = look(error, database) {
            return Some(found);
        }
        link = error.source();
    }
    None
}

/// [`find`] with `look` applied to the driver's error of a link first (the concrete
/// `PgDatabaseError`, `MySqlDatabaseError` or `SqliteError`), then to the link itself.
pub(crate) fn find_either<'e, T>(
    error: &'e (dyn StdError + 'static),
    look: impl Fn(&'e (dyn StdError + 'static)) -> Option<T>,
) -> Option<T> {
    find(error, |link, database| {
        database
            .and_then(|database| look(database.as_error()))
            .or_else(|| look(link))
    })
}
