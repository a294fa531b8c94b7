//! The error a handler returned for an invalid message id read "error occurred while
//! encoding a value: invalid message id: it is empty": it travelled as
//! `sqlx::Error::Encode`, whose text sqlx writes, so a log line or a dead-letter reason
//! began by naming a failure that did not happen (nothing was encoded, nothing reached the
//! database). It is now a `sqlx::Error::InvalidArgument` carrying the id error's own text,
//! which `InvalidMessageId::find` reads back into the typed error.
//!
//! On every backend, through each error type of the table in tests/suite/failures.rs that can
//! see a database error (not the opaque one, which keeps a string): the text the caller
//! reads starts with the words naming the invalid message id (for a type with its own
//! words, such as `#[error("database error")]`, its source's text does), `find` gives the
//! typed error back, and `AckPolicy`'s classification is permanent (dead-letter).

use std::error::Error as StdError;

use dedup_runtime::{Backend, Failure, InvalidMessageId, MAX_MESSAGE_ID_LEN, idempotent};

#[derive(Debug, thiserror::Error)]
enum FromError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

#[derive(Debug, thiserror::Error)]
enum TransparentError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

type BoxError = Box<dyn StdError + Send + Sync>;

/// The words the caller must read first.
const FIRST_WORDS: &str = "invalid message id: ";

/// What the caller of a handler that refused `expected` sees: `text`, the error as it
/// would be logged, starts with [`FIRST_WORDS`]; the typed error is found in `error`; a
/// broker would dead-letter the message.
fn check<DB: Backend>(text: &str, error: &(dyn StdError + 'static), expected: &InvalidMessageId) {
    assert!(text.starts_with(FIRST_WORDS), "{text}");
    assert_eq!(text, expected.to_string());
    assert_eq!(
        InvalidMessageId::find(error).as_ref(),
        Some(expected),
        "{text}"
    );
    assert_eq!(Failure::of::<DB>(error), Failure::Permanent, "{text}");
}

macro_rules! invalid_id_suite {
    ($backend:ident, conn = $conn:ty, pool = $pool:expr $(,)?) => {
        mod $backend {
            use super::*;

            type Db = <$conn as sqlx::Connection>::Database;

            #[idempotent(consumer = "regress-invalid-id", key = id)]
            async fn via_sqlx(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "regress-invalid-id", key = id)]
            async fn via_anyhow(tx: &mut $conn, id: &str) -> anyhow::Result<()> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "regress-invalid-id", key = id)]
            async fn via_thiserror_from(tx: &mut $conn, id: &str) -> Result<(), FromError> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "regress-invalid-id", key = id)]
            async fn via_thiserror_transparent(
                tx: &mut $conn,
                id: &str,
            ) -> Result<(), TransparentError> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "regress-invalid-id", key = id)]
            async fn via_box_dyn_error(tx: &mut $conn, id: &str) -> Result<(), BoxError> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[tokio::test]
            async fn the_first_words_name_the_invalid_message_id() {
                let pool = $pool;
                let long = "x".repeat(MAX_MESSAGE_ID_LEN + 1);
                let cases = [
                    ("", InvalidMessageId::Empty),
                    (
                        long.as_str(),
                        InvalidMessageId::TooLong {
                            len: MAX_MESSAGE_ID_LEN + 1,
                            max: MAX_MESSAGE_ID_LEN,
                        },
                    ),
                    ("evt\0x", InvalidMessageId::ContainsNul { position: 3 }),
                ];
                for (id, expected) in &cases {
                    let error = via_sqlx(&*pool, id).await.unwrap_err();
                    check::<Db>(&error.to_string(), &error, expected);

                    let error = via_anyhow(&*pool, id).await.unwrap_err();
                    check::<Db>(&format!("{error}"), error.as_ref(), expected);
                    check::<Db>(&format!("{error:#}"), error.as_ref(), expected);

                    // Its own words first, as the type says; the source's are ours.
                    let error = via_thiserror_from(&*pool, id).await.unwrap_err();
                    assert_eq!(error.to_string(), "database error");
                    let source = error.source().expect("the sqlx::Error").to_string();
                    check::<Db>(&source, &error, expected);

                    let error = via_thiserror_transparent(&*pool, id).await.unwrap_err();
                    check::<Db>(&error.to_string(), &error, expected);

                    let error = via_box_dyn_error(&*pool, id).await.unwrap_err();
                    check::<Db>(&error.to_string(), error.as_ref(), expected);
                }
            }
        }
    };
}

invalid_id_suite!(
    postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
);
invalid_id_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
);
invalid_id_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
);
