//! A handler whose connection names a backend this build of the runtime leaves out.
//!
//! The attribute wraps a handler on `PgConnection` (`SqliteConnection`, `MySqlConnection`,
//! `Transaction<'_, Postgres>` …) in `__private::backend_postgres! { {handler} {placeholder} }`.
//! With the backend's feature, that is the handler. Without it, it is one error that names
//! the feature, and a placeholder with the handler's name and outcome type, so that callers
//! type-check and no other error shows (without the feature the connection type is, to the
//! runtime, no connection at all: a dozen errors that said to write what was written).
//! One pair of definitions per backend, written out: a `macro_rules!` that defines an
//! exported macro could not be named by path.

#[cfg(feature = "postgres")]
#[doc(hidden)]
#[macro_export]
macro_rules! __dedup_backend_postgres {
    ({$($handler:tt)*} {$($placeholder:tt)*}) => { $($handler)* };
}

#[cfg(not(feature = "postgres"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __dedup_backend_postgres {
    ({$($handler:tt)*} {$($placeholder:tt)*}) => {
        ::core::compile_error!(
            "this handler runs on `PgConnection`, and dedup-runtime is built without its \
             `postgres` feature: in Cargo.toml, write `dedup-runtime = { version = \"0.1\", \
             features = [\"postgres\"] }` (with sqlx 0.9 and its `postgres` feature)"
        );
        $($placeholder)*
    };
}

#[cfg(feature = "sqlite")]
#[doc(hidden)]
#[macro_export]
macro_rules! __dedup_backend_sqlite {
    ({$($handler:tt)*} {$($placeholder:tt)*}) => { $($handler)* };
}

#[cfg(not(feature = "sqlite"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __dedup_backend_sqlite {
    ({$($handler:tt)*} {$($placeholder:tt)*}) => {
        ::core::compile_error!(
            "this handler runs on `SqliteConnection`, and dedup-runtime is built without its \
             `sqlite` feature: in Cargo.toml, write `dedup-runtime = { version = \"0.1\", \
             features = [\"sqlite\"] }` (with sqlx 0.9 and its `sqlite` feature)"
        );
        $($placeholder)*
    };
}

#[cfg(feature = "mysql")]
#[doc(hidden)]
#[macro_export]
macro_rules! __dedup_backend_mysql {
    ({$($handler:tt)*} {$($placeholder:tt)*}) => { $($handler)* };
}

#[cfg(not(feature = "mysql"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __dedup_backend_mysql {
    ({$($handler:tt)*} {$($placeholder:tt)*}) => {
        ::core::compile_error!(
            "this handler runs on `MySqlConnection`, and dedup-runtime is built without its \
             `mysql` feature: in Cargo.toml, write `dedup-runtime = { version = \"0.1\", \
             features = [\"mysql\"] }` (with sqlx 0.9 and its `mysql` feature)"
        );
        $($placeholder)*
    };
}
