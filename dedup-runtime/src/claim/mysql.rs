//! MySQL and MariaDB: a plain insert whose duplicate-key error is the duplicate, a
//! transaction out of autocommit mode, and a checked commit.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, Connection, MySql, Transaction};

use super::{ClaimBackend, Claimed, Claiming, Statements, Tx};
use crate::claim::Found;
use crate::classify::mysql::ENGLISH;
use crate::dialect::mysql::{ER_BAD_FIELD, ER_DUP_ENTRY, ER_SAVEPOINT_GONE, error_number};
use crate::rolled_back::RolledBack;
use crate::stored::{Recalled, Remembered, fetch_recalled};

/// The savepoint every transaction of the handler's own begins with, and its checked
/// commit releases: one name for the statements below.
macro_rules! alive {
    () => {
        "dedup_alive"
    };
}

/// The handler's own transactions run out of autocommit mode. InnoDB rolls the whole
/// transaction back on a deadlock and ends it: in autocommit mode a body that swallowed
/// the error would write the rest of its effects one committed statement at a time, with
/// no dedup row. With `autocommit = 0` they go into a new transaction, which the checked
/// commit refuses to commit: the transaction begins with a savepoint, `dedup_alive`, gone
/// with it, and the commit releases it first ([`CHECKED_COMMIT`]). The savepoint is there
/// as long as its transaction is, whatever the body does with savepoints of its own (sqlx
/// names them `_sqlx_savepoint_<n>` and sets them later: rolling back to one keeps it).
/// Every end of the transaction sets autocommit back ([`RESTORE_ROLLBACK`],
/// [`CHECKED_COMMIT`]); a pooled connection whose call ends without that is closed (see
/// `ClaimBackend::CHANGES_SESSION`). An inbox worker's transaction begins the same way and
/// ends with the same commit.
pub(crate) const BEGIN: &str = concat!("SET autocommit = 0; BEGIN; SAVEPOINT ", alive!());
/// With `unique = …`: the session's messages in English first ([`ENGLISH`]), so that a
/// violated key can be read off its 1062.
const ENGLISH_THEN_BEGIN: &str = concat!(
    "SET SESSION lc_messages = 'en_US'; SET autocommit = 0; BEGIN; SAVEPOINT ",
    alive!()
);
/// After a claim that found its row: the failed insert's lock released, and a new
/// transaction with its savepoint.
const ROLLBACK_THEN_BEGIN: &str = concat!("ROLLBACK; BEGIN; SAVEPOINT ", alive!());
/// The claim's start: out of autocommit mode and the savepoint. No `BEGIN`: out of
/// autocommit mode the savepoint and the insert after it are already in a transaction
/// (the insert's makes sqlx count it open), and a statement less is a fifth of the
/// difference to a hand-written transaction.
const CLAIM_BEGIN: &str = concat!("SET autocommit = 0; SAVEPOINT ", alive!());
/// [`CLAIM_BEGIN`] with the session's messages in English first.
const ENGLISH_THEN_CLAIM_BEGIN: &str = concat!(
    "SET SESSION lc_messages = 'en_US'; SET autocommit = 0; SAVEPOINT ",
    alive!()
);

/// The checked commit: `RELEASE SAVEPOINT` fails (1305, [`ER_SAVEPOINT_GONE`]) when the
/// transaction that set it has ended — a deadlock the body swallowed, a `ROLLBACK` it
/// sent — and the rest of the query is not run: no `COMMIT` of what the body wrote after.
/// Then autocommit back, in the same round trip, which commits (a change of `autocommit`
/// from 0 to 1 commits the open transaction, and fails as `COMMIT` would: the error is
/// the `SET`'s, and autocommit stays off). Reading the dedup row instead (the form this
/// replaces) cost MariaDB a fifth of its calls per second: a statement that opens the
/// table, against one that touches no table.
const CHECKED_COMMIT: &str = concat!("RELEASE SAVEPOINT ", alive!(), "; SET autocommit = 1");
const RESTORE_ROLLBACK: &str = "ROLLBACK; SET autocommit = 1";

/// What the claim's insert remembers for a slow transaction's commit
/// (`Statements::mysql_commit_stamped`), for a row the handler's transaction takes over
/// instead.
const REMEMBER: &str =
    "SET @dedup_consumer = ?, @dedup_message_id = ?, @dedup_claimed_at = UTC_TIMESTAMP(6)";

/// The claim sent with `BEGIN`, one multi-statement query (one round trip): out of
/// autocommit mode, `BEGIN` and its savepoint, and the claim's insert with its values
/// written in as hex literals (`X'…'`, binary strings for the `VARBINARY` columns):
/// nothing in an id reaches the SQL parser as anything but `0-9a-f`, whatever
/// `NO_BACKSLASH_ESCAPES` says.
/// Its duplicate-key error (1062) is the row found there.
///
/// ```sql
/// SET autocommit = 0; SAVEPOINT dedup_alive;
/// INSERT INTO processed_messages (consumer, message_id, processed_at)
/// VALUES (@dedup_consumer := X'62696c6c696e67', @dedup_message_id := X'6d2d31',
///         @dedup_claimed_at := UTC_TIMESTAMP(6))
/// ```
pub(crate) fn begin_claim_sql(
    table: &str,
    consumer: &str,
    id: &str,
    business_keys: bool,
) -> String {
    let begin = if business_keys {
        ENGLISH_THEN_CLAIM_BEGIN
    } else {
        CLAIM_BEGIN
    };
    let mut sql = String::with_capacity(200 + table.len() + 2 * (consumer.len() + id.len()));
    sql.push_str(begin);
    sql.push_str("; INSERT INTO ");
    sql.push_str(table);
    sql.push_str(" (consumer, message_id, processed_at) VALUES (@dedup_consumer := X'");
    super::push_hex(&mut sql, consumer.as_bytes());
    sql.push_str("', @dedup_message_id := X'");
    super::push_hex(&mut sql, id.as_bytes());
    sql.push_str("', @dedup_claimed_at := UTC_TIMESTAMP(6))");
    sql
}

/// A duplicate's look at its row, with the `ROLLBACK` of its failed claim and autocommit
/// restored: one multi-statement query, outside any transaction; a row only if it is a
/// processed one (`state IS NULL`; a table of migration `0001`, without `state`, fails with 1054 after
/// the rollback, and is looked at the other way).
pub(crate) fn look_processed_sql(table: &str, consumer: &str, id: &str) -> String {
    let mut sql = String::with_capacity(150 + table.len() + 2 * (consumer.len() + id.len()));
    sql.push_str(RESTORE_ROLLBACK);
    sql.push_str("; SELECT 1 FROM ");
    sql.push_str(table);
    sql.push_str(" WHERE consumer = X'");
    super::push_hex(&mut sql, consumer.as_bytes());
    sql.push_str("' AND message_id = X'");
    super::push_hex(&mut sql, id.as_bytes());
    sql.push_str("' AND state IS NULL");
    sql
}

/// ER_DATA_OUT_OF_RANGE: what a slow transaction's commit raises when the dedup row is no
/// longer this transaction's own (an error whatever the `sql_mode`).
const CLAIM_GONE: u16 = 1690;

impl ClaimBackend for MySql {
    fn claim_sql(statements: &Statements) -> &'static str {
        statements.mysql
    }

    async fn claim<'c>(
        conn: &'c mut MySqlConnection,
        _: &'static Statements,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Claiming, sqlx::Error> {
        let result = super::execute_keyed::<Self>(conn, sql, consumer, id).await;
        match result {
            Ok(_) => Ok(Claiming::Inserted),
            Err(error) if error_number(&error) == Some(ER_DUP_ENTRY) => Ok(Claiming::Found(None)),
            Err(error) => Err(error),
        }
    }

    fn nested_claim_sql(statements: &Statements) -> &'static str {
        statements.mysql_nested
    }

    async fn inspect<'c>(
        conn: &'c mut MySqlConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Option<Found>, sqlx::Error> {
        let row = match sqlx::query(statements.mysql_inspect)
            .bind(consumer)
            .bind(id)
            .fetch_optional(conn)
            .await
        {
            Ok(row) => row,
            // A table of migration `0001`, not upgraded yet: no `state`, only processed rows.
            Err(error) if error_number(&error) == Some(ER_BAD_FIELD) => {
                return Ok(Some(Found::PROCESSED));
            }
            Err(error) => return Err(error),
        };
        row.map(|row| Found::from_mysql(&row, 0)).transpose()
    }

    async fn recall<'c>(
        conn: &'c mut MySqlConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Option<Recalled>, sqlx::Error> {
        let sql = statements.mysql_recall;
        fetch_recalled::<Self, i32>(conn, sql, consumer, id).await
    }

    async fn store<'c>(
        conn: &'c mut MySqlConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        remembered: Remembered<'c>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(statements.mysql_store)
            .bind(remembered.result)
            .bind(remembered.version)
            .bind(remembered.fingerprint)
            .bind(consumer)
            .bind(id)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// In the handler's own transaction the row becomes the one a slow commit stamps:
    /// the session variables are set first, as the claim would have set them.
    async fn take_over<'c>(
        conn: &'c mut MySqlConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        fingerprint: Option<&'c [u8]>,
        owned: bool,
    ) -> Result<bool, sqlx::Error> {
        if owned {
            super::execute_keyed::<Self>(&mut *conn, REMEMBER, consumer, id).await?;
        }
        let sql = match fingerprint {
            None => statements.mysql_take_over,
            Some(_) => statements.mysql_take_over_printed,
        };
        let mut query = sqlx::query(sql).bind(owned).bind(consumer).bind(id);
        if let Some(fingerprint) = fingerprint {
            query = query.bind(fingerprint);
        }
        let done = query.execute(conn).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn stamp<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<(), sqlx::Error> {
        super::execute_keyed::<Self>(conn, sql, consumer, id)
            .await
            .map(drop)
    }

    fn stamp_sql(_: &Statements) -> Option<&'static str> {
        None
    }

    const CHANGES_SESSION: bool = true;

    fn begin_owned(
        conn: &mut MySqlConnection,
        business_keys: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin_with(if business_keys {
            ENGLISH_THEN_BEGIN
        } else {
            BEGIN
        })
    }

    /// (A lent connection keeps the claim's own round trip: the driver cannot queue a
    /// `ROLLBACK` without waiting, for a call cancelled with the claim in flight.)
    fn begin_claim_sql(
        statements: &Statements,
        consumer: &str,
        id: &str,
        business_keys: bool,
    ) -> Option<String> {
        Some(begin_claim_sql(
            statements.table,
            consumer,
            id,
            business_keys,
        ))
    }

    fn found_row(error: &sqlx::Error) -> bool {
        error_number(error) == Some(ER_DUP_ENTRY)
    }

    /// Still out of autocommit mode: the `ROLLBACK` also releases the lock the failed
    /// insert took on the row it found.
    fn begin_again(
        conn: &mut MySqlConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin_with(ROLLBACK_THEN_BEGIN)
    }

    fn look_processed<'c>(
        conn: &'c mut MySqlConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<Option<bool>, sqlx::Error>> + Send + 'c {
        let sql = look_processed_sql(statements.table, consumer, id);
        async move {
            match sqlx::raw_sql(AssertSqlSafe(sql)).fetch_optional(conn).await {
                Ok(row) => Ok(Some(row.is_some())),
                // Rolled back and in autocommit again; the row is read the other way.
                Err(error) if error_number(&error) == Some(ER_BAD_FIELD) => Ok(Some(false)),
                Err(error) => Err(error),
            }
        }
    }

    /// The checked commit ([`CHECKED_COMMIT`]): `COMMIT` goes out only while the
    /// transaction is the one that began (and claimed), and autocommit is restored; one
    /// round trip. A transaction slower than `STAMP_AFTER` moves its row's `processed_at`
    /// to the commit time first, and fails unless the row is still its own
    /// (`Statements::mysql_commit_stamped`). (sqlx still counts the transaction open: its
    /// queued `ROLLBACK` is a no-op.)
    async fn commit_owned<'t>(
        tx: Tx<'t, Self>,
        claimed: Option<Claimed<'t>>,
        pooled: bool,
    ) -> Result<(), sqlx::Error> {
        let Tx { mut tx, unclean } = tx;
        let sql = match claimed {
            Some(claimed) if claimed.slow => claimed.statements.mysql_commit_stamped,
            _ => CHECKED_COMMIT,
        };
        match sqlx::raw_sql(sql).execute(&mut *tx).await {
            Ok(_) => {
                unclean.store(false, std::sync::atomic::Ordering::Relaxed);
                super::discard(tx, pooled).await;
                Ok(())
            }
            Err(error) => {
                let gone = matches!(error_number(&error), Some(CLAIM_GONE | ER_SAVEPOINT_GONE));
                if sqlx::raw_sql(RESTORE_ROLLBACK)
                    .execute(&mut *tx)
                    .await
                    .is_ok()
                {
                    unclean.store(false, std::sync::atomic::Ordering::Relaxed);
                }
                super::discard(tx, pooled).await;
                Err(if gone {
                    RolledBack::error("MySQL", Some(error))
                } else {
                    error
                })
            }
        }
    }

    /// Always awaited: the session's autocommit is restored in the same round trip.
    async fn rollback_owned<'t>(
        tx: Tx<'t, Self>,
        pooled: bool,
        _: bool,
    ) -> Result<(), sqlx::Error> {
        let Tx { mut tx, unclean } = tx;
        let result = sqlx::raw_sql(RESTORE_ROLLBACK).execute(&mut *tx).await;
        if result.is_ok() {
            unclean.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        super::discard(tx, pooled).await;
        result.map(drop)
    }

    async fn begin_nested(
        conn: &mut MySqlConnection,
        business_keys: bool,
    ) -> Result<Transaction<'_, Self>, sqlx::Error> {
        if business_keys {
            sqlx::raw_sql(ENGLISH).execute(&mut *conn).await?;
        }
        conn.begin().await
    }
}
