//! Seeing through the handler's error type `E` to the database error inside it.
//!
//! The body's `?` has already turned a `sqlx::Error` into `E` when the generated code
//! sees it. Which way leads back depends on `E`, and the generated code picks it with
//! autoref specialisation: the first of these that applies wins.
//!
//! 1. `E: Error` (`sqlx::Error`, `thiserror` enums): `E` itself and its `source()` chain.
//! 2. `E: AsRef<dyn Error + Send + Sync>` (`anyhow::Error`, `Box<dyn Error + Send + Sync>`).
//! 3. `E: AsRef<dyn Error>` (`Box<dyn Error>`).
//! 4. anything else: nothing is found, so a transient failure inside the body is not
//!    retried. `E` generic in the handler lands here too.

#![allow(missing_docs)]

use std::error::Error as StdError;

pub struct Probe<'a, E>(pub &'a E);

pub trait ViaError<'a> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)>;
}

impl<'a, E: StdError + 'static> ViaError<'a> for &&&Probe<'a, E> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)> {
        Some(self.0)
    }
}

pub trait ViaSendSyncRef<'a> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)>;
}

impl<'a, E: AsRef<dyn StdError + Send + Sync + 'static>> ViaSendSyncRef<'a> for &&Probe<'a, E> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)> {
        Some(self.0.as_ref())
    }
}

pub trait ViaRef<'a> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)>;
}

impl<'a, E: AsRef<dyn StdError + 'static>> ViaRef<'a> for &Probe<'a, E> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)> {
        Some(self.0.as_ref())
    }
}

pub trait Opaque<'a> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)>;
}

impl<'a, E> Opaque<'a> for Probe<'a, E> {
    fn __dedup_error(&self) -> Option<&'a (dyn StdError + 'static)> {
        None
    }
}

/// `probe!(&error)`: the `dyn Error` view of the handler's error, if `E` offers one.
#[doc(hidden)]
#[macro_export]
macro_rules! __probe {
    ($error:expr) => {{
        #[allow(unused_imports)]
        use $crate::__private::probe::{
            Opaque as _, ViaError as _, ViaRef as _, ViaSendSyncRef as _,
        };
        (&&&$crate::__private::probe::Probe($error)).__dedup_error()
    }};
}

#[cfg(test)]
mod tests {
    use super::Probe;
    use std::error::Error as StdError;

    fn message(found: Option<&(dyn StdError + 'static)>) -> Option<String> {
        found.map(ToString::to_string)
    }

    #[test]
    fn finds_the_error_behind_each_kind_of_type() {
        let sqlx = sqlx::Error::RowNotFound;
        let expected = Some(sqlx.to_string());
        assert_eq!(message(crate::__probe!(&sqlx)), expected);

        let boxed: Box<dyn StdError + Send + Sync> = Box::new(sqlx::Error::RowNotFound);
        assert_eq!(message(crate::__probe!(&boxed)), expected);

        let local: Box<dyn StdError> = Box::new(sqlx::Error::RowNotFound);
        assert_eq!(message(crate::__probe!(&local)), expected);

        struct Hidden;
        assert_eq!(message(crate::__probe!(&Hidden)), None);
        let _ = Probe(&());
    }
}
