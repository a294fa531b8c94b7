//! MySQL and MariaDB: the SQL and the error numbers every concern's MySQL file shares.

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, MySql, Pool};

/// The MySQL/MariaDB error number of `error`, when it is the server's.
pub(crate) fn error_number(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// ER_BAD_FIELD_ERROR: an unknown column (a dedup table of migration `0001`, before `migrate`
/// upgrades it, has no `state`).
pub(crate) const ER_BAD_FIELD: u16 = 1054;

/// ER_DUP_ENTRY: a unique key, or for the claim statement the dedup table's primary key.
pub(crate) const ER_DUP_ENTRY: u16 = 1062;

/// ER_SP_DOES_NOT_EXIST, for `RELEASE SAVEPOINT`: the savepoint is gone with the
/// transaction it was set in (InnoDB ended it on a deadlock, or a `ROLLBACK` did).
pub(crate) const ER_SAVEPOINT_GONE: u16 = 1305;

/// A worker's or a relay's claim transaction: READ COMMITTED, so no gap locks, and
/// claiming processes skip each other's rows instead of deadlocking on the index ranges
/// they scan.
pub(crate) const READ_COMMITTED: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// A value bound to a [`update_found`] statement.
#[derive(Clone, Copy)]
pub(crate) enum Arg<'a> {
    Text(&'a str),
    Bytes(&'a [u8]),
    I64(i64),
}

/// `lists` in order, as one statement's arguments.
fn arguments(lists: &[&[Arg<'_>]]) -> Result<sqlx::mysql::MySqlArguments, sqlx::Error> {
    use sqlx::Arguments as _;
    let mut arguments = sqlx::mysql::MySqlArguments::default();
    for arg in lists.iter().flat_map(|list| list.iter()) {
        match *arg {
            Arg::Text(text) => arguments.add(text.to_owned()),
            Arg::Bytes(bytes) => arguments.add(bytes.to_vec()),
            Arg::I64(number) => arguments.add(number),
        }
        .map_err(sqlx::Error::Encode)?;
    }
    Ok(arguments)
}

/// `UPDATE {table} SET {set} WHERE {filter}` for a filter on a secondary index (a state,
/// an owner), without deadlocking against the updates by primary key (a worker's mark, a
/// relay's sent). InnoDB's update through a secondary index locks the index entry, then
/// the row: the reverse of an update by primary key, which locks the row, then moves its
/// index entry — a cycle that a claim's bury and a mark closed under load. So the keys
/// come from a plain read (a snapshot: no locks), and the `UPDATE` goes by primary key,
/// `filter` checked again on each row under its lock, in one READ COMMITTED transaction
/// (no gap locks). `key`: the primary key's last column, `filter` fixing the ones before
/// it. How many rows it changed.
pub(crate) async fn update_found(
    pool: &Pool<MySql>,
    table: &str,
    key: &str,
    set: (&str, &[Arg<'_>]),
    filter: (&str, &[Arg<'_>]),
) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin_with(READ_COMMITTED).await?;
    let done = update_found_in(&mut tx, table, key, set, filter).await?;
    tx.commit().await?;
    Ok(done)
}

/// [`update_found`] inside the caller's READ COMMITTED transaction `conn`.
pub(crate) async fn update_found_in(
    conn: &mut sqlx::MySqlConnection,
    table: &str,
    key: &str,
    set: (&str, &[Arg<'_>]),
    filter: (&str, &[Arg<'_>]),
) -> Result<u64, sqlx::Error> {
    let find = format!("SELECT {key} FROM {table} WHERE {}", filter.0);
    let keys: Vec<Vec<u8>> = sqlx::query_scalar_with(AssertSqlSafe(find), arguments(&[filter.1])?)
        .fetch_all(&mut *conn)
        .await?;
    if keys.is_empty() {
        return Ok(0);
    }
    let keys: Vec<Arg<'_>> = keys.iter().map(|key| Arg::Bytes(key)).collect();
    let sql = format!(
        "UPDATE {table} FORCE INDEX (PRIMARY) SET {} WHERE ({}) AND {key} IN ({})",
        set.0,
        filter.0,
        placeholders(keys.len())
    );
    let done = sqlx::query_with(AssertSqlSafe(sql), arguments(&[set.1, filter.1, &keys])?)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected())
}

/// `count` parameters, `?, ?, …`, for an `IN (…)` list.
pub(crate) fn placeholders(count: usize) -> String {
    let mut list = String::with_capacity(3 * count);
    for index in 0..count {
        list.push_str(if index > 0 { ", ?" } else { "?" });
    }
    list
}
