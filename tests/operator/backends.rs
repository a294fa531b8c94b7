//! What differs per backend in these tests: the pool, its URL for the command, and the
//! SQL that makes rows dead and old.

use dedup_runtime::Backend;
use sqlx::Pool;

/// One backend under test.
pub trait Under: Backend + dedup_suite::TestDatabase + Exec {
    /// `UPDATE {table} SET state = 3, attempts = 5, last_error = {p1} WHERE consumer = {p2}`
    /// with the rows made `days` old.
    fn kill_sql(table: &str, days: u32) -> String;
    /// Inserts an outcome-unknown row (`consumer`, `id`) into the dedup table `table`.
    fn unknown_sql(table: &str) -> String;
}

impl Under for sqlx::Postgres {
    fn kill_sql(table: &str, days: u32) -> String {
        let since = if table.contains("outbox") {
            "created_at"
        } else {
            "received_at"
        };
        format!(
            "UPDATE {table} SET state = 3, attempts = 5, last_error = $1, \
             {since} = clock_timestamp() - interval '{days} days' WHERE consumer = $2"
        )
    }
    fn unknown_sql(table: &str) -> String {
        format!(
            "INSERT INTO {table} (consumer, message_id, state, owner, expires_at) \
             VALUES ($1, $2, 2, '\\x00', '2001-01-01T00:00:00Z')"
        )
    }
}

impl Under for sqlx::MySql {
    fn kill_sql(table: &str, days: u32) -> String {
        let since = if table.contains("outbox") {
            "created_at"
        } else {
            "received_at"
        };
        format!(
            "UPDATE {table} SET state = 3, attempts = 5, last_error = ?, \
             {since} = UTC_TIMESTAMP(6) - INTERVAL {days} DAY WHERE consumer = ?"
        )
    }
    fn unknown_sql(table: &str) -> String {
        format!(
            "INSERT INTO {table} (consumer, message_id, state, owner, expires_at) \
             VALUES (?, ?, 2, x'00000000000000000000000000000000', '2001-01-01 00:00:00')"
        )
    }
}

impl Under for sqlx::Sqlite {
    fn kill_sql(table: &str, days: u32) -> String {
        let since = if table.contains("outbox") {
            "created_at"
        } else {
            "received_at"
        };
        format!(
            "UPDATE {table} SET state = 3, attempts = 5, last_error = ?1, \
             {since} = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-{days} days') WHERE consumer = ?2"
        )
    }
    fn unknown_sql(table: &str) -> String {
        format!(
            "INSERT INTO {table} (consumer, message_id, state, owner, expires_at) \
             VALUES (?1, ?2, 2, x'00', '2001-01-01T00:00:00.000Z')"
        )
    }
}

/// Runs `sql` with two text parameters; the rows it changed.
pub async fn exec<DB: Under>(pool: &Pool<DB>, sql: String, first: &str, second: &str) -> u64 {
    DB::exec(pool, sql, first.to_owned(), second.to_owned()).await
}

macro_rules! exec_impls {
    ($($db:ty),*) => {$(
        impl Exec for $db {
            async fn exec(pool: &Pool<Self>, sql: String, first: String, second: String) -> u64 {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(first)
                    .bind(second)
                    .execute(pool)
                    .await
                    .unwrap()
                    .rows_affected()
            }
        }
    )*};
}

/// Runs a statement with two text parameters.
pub trait Exec: Backend {
    /// Runs `sql`.
    fn exec(
        pool: &Pool<Self>,
        sql: String,
        first: String,
        second: String,
    ) -> impl std::future::Future<Output = u64> + Send;
}

exec_impls!(sqlx::Postgres, sqlx::MySql, sqlx::Sqlite);

/// `backends!(suite)`: `suite!(module, db, pool expression, url expression)` per backend.
macro_rules! backends {
    ($suite:ident) => {
        $suite!(
            postgres,
            sqlx::Postgres,
            Box::new(dedup_suite::postgres().await),
            |_db| dedup_suite::postgres_url()
        );
        $suite!(
            mysql,
            sqlx::MySql,
            Box::new(dedup_suite::mysql().await),
            |_db| dedup_suite::mysql_url()
        );
        $suite!(
            sqlite,
            sqlx::Sqlite,
            dedup_suite::sqlite().await,
            |db| format!("sqlite:{}", db.path().display())
        );
    };
}
pub(crate) use backends;

/// Receives `ids` into the inbox table `table` for `consumer` with `payload`.
pub async fn receive<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    consumer: &str,
    ids: &[String],
    payload: &[u8],
) {
    let inbox = dedup_runtime::inbox::Inbox::new(pool, consumer)
        .unwrap()
        .in_table(table)
        .unwrap();
    for chunk in ids.chunks(500) {
        let messages: Vec<_> = chunk
            .iter()
            .map(|id| dedup_runtime::inbox::Incoming::new(id.as_str(), payload).headers(b"opaque"))
            .collect();
        for answer in inbox.receive_batch(&messages).await.unwrap() {
            answer.unwrap();
        }
    }
}
