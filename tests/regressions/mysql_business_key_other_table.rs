//! MariaDB/MySQL business keys matched another table's key of the same name. Key names
//! are unique only per table (`UNIQUE KEY order_id (order_id)` is `order_id` on every
//! table that has one), and MariaDB's error 1062 names the key without its table: with
//! `unique = "order_id"`, a collision on a *different* table's `order_id` returned
//! `Duplicate::BusinessKey`, so the caller acknowledged a message whose work was never
//! done. MySQL 8 names `table.key`, and the table was dropped (issue 8, defect 6).
//!
//! A name now matches only when the current database has exactly one table with a unique
//! key of that name (and, for `table.key`, it is that table); otherwise the violation is
//! an error.

use dedup_runtime::{Duplicate, Outcome, idempotent};
use sqlx::mysql::{MySqlConnection, MySqlPool};
use sqlx::{AssertSqlSafe, Connection as _};

const CONSUMER: &str = "regress-business-key-other-table";

/// Place an order: the body inserts the order id into each of `tables`.
struct Order {
    id: String,
    order_id: String,
    tables: Vec<String>,
}

impl Order {
    fn new(order_id: &str, tables: &[&str]) -> Self {
        Order {
            id: dedup_suite::unique("msg"),
            order_id: order_id.to_owned(),
            tables: tables.iter().map(|table| (*table).to_owned()).collect(),
        }
    }
}

async fn insert_all(tx: &mut MySqlConnection, msg: &Order) -> Result<(), sqlx::Error> {
    for table in &msg.tables {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} (order_id) VALUES (?)"
        )))
        .bind(&msg.order_id)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

#[idempotent(consumer = "regress-business-key-other-table", key = msg.id, unique = "order_id")]
async fn place(tx: &mut MySqlConnection, msg: &Order) -> Result<(), sqlx::Error> {
    insert_all(tx, msg).await
}

#[idempotent(
    consumer = "regress-business-key-other-table",
    key = msg.id,
    unique = "dedup_regress_solo_key"
)]
async fn solo(tx: &mut MySqlConnection, msg: &Order) -> Result<(), sqlx::Error> {
    insert_all(tx, msg).await
}

#[idempotent(
    consumer = "regress-business-key-other-table",
    key = msg.id,
    unique = "dedup_regress_solo.dedup_regress_solo_key"
)]
async fn solo_qualified(tx: &mut MySqlConnection, msg: &Order) -> Result<(), sqlx::Error> {
    insert_all(tx, msg).await
}

#[idempotent(
    consumer = "regress-business-key-other-table",
    key = msg.id,
    unique = "dedup_regress_twin.dedup_regress_solo_key"
)]
async fn solo_elsewhere(tx: &mut MySqlConnection, msg: &Order) -> Result<(), sqlx::Error> {
    insert_all(tx, msg).await
}

async fn execute(pool: &MySqlPool, sql: String) {
    sqlx::raw_sql(AssertSqlSafe(sql.clone()))
        .execute(pool)
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
}

/// A table with a unique key `key` on `order_id`.
async fn create(pool: &MySqlPool, table: &str, key: &str) {
    execute(
        pool,
        format!(
            "CREATE TABLE {table} (order_id VARBINARY(255) NOT NULL, \
             UNIQUE KEY {key} (order_id)) ENGINE = InnoDB"
        ),
    )
    .await;
}

async fn orders(pool: &MySqlPool, table: &str, order_id: &str) -> i64 {
    dedup_suite::rows(pool, table, "order_id", order_id).await
}

async fn claims(pool: &MySqlPool, msg: &Order) -> i64 {
    dedup_suite::claims(pool, CONSUMER, &msg.id).await
}

/// The call failed with the unique violation itself, and committed nothing.
async fn assert_refused(
    pool: &MySqlPool,
    result: Result<Outcome<()>, sqlx::Error>,
    msg: &Order,
    why: &str,
) {
    let error = match result {
        Err(error) => error,
        Ok(outcome) => panic!("{why}: expected the violation as an error, got {outcome:?}"),
    };
    let database = error.as_database_error().expect("a database error");
    assert_eq!(
        database.kind(),
        sqlx::error::ErrorKind::UniqueViolation,
        "{why}: {error}"
    );
    assert_eq!(claims(pool, msg).await, 0, "{why}: no dedup row");
}

fn fresh_table() -> String {
    dedup_suite::unique_table("regress_bk")
}

/// Two tables with a key named `order_id`; the body's insert into the other one
/// collides. Not the handler's business key: an error, nothing committed.
#[tokio::test]
async fn another_tables_key_of_the_same_name_is_an_error() {
    let pool = dedup_suite::mysql().await;
    let (own, other) = (fresh_table(), fresh_table());
    create(&pool, &own, "order_id").await;
    create(&pool, &other, "order_id").await;
    let order = dedup_suite::unique("order");
    execute(
        &pool,
        format!("INSERT INTO {other} (order_id) VALUES ('{order}')"),
    )
    .await;

    let msg = Order::new(&order, &[&own, &other]);
    let result = place(&pool, &msg).await;
    assert_refused(&pool, result, &msg, "the other table's key").await;
    assert_eq!(orders(&pool, &own, &order).await, 0, "the work rolled back");
    assert_eq!(orders(&pool, &other, &order).await, 1);

    // Even on the handler's own table: which `order_id` it was, MariaDB does not say.
    let mine = dedup_suite::unique("order");
    execute(
        &pool,
        format!("INSERT INTO {own} (order_id) VALUES ('{mine}')"),
    )
    .await;
    let msg = Order::new(&mine, &[&own]);
    let result = place(&pool, &msg).await;
    assert_refused(&pool, result, &msg, "an ambiguous key name").await;
    assert_eq!(orders(&pool, &own, &mine).await, 1);

    execute(&pool, format!("DROP TABLE {own}, {other}")).await;
}

/// A key name only one table of the database has is a business key, plain or as
/// `table.key`; `other_table.key` is not. The tables have fixed names (a `table.key` in
/// `unique` is a literal), so the test holds a named lock against concurrent runs.
#[tokio::test]
async fn a_key_name_unique_in_the_database_is_a_business_key() {
    let pool = dedup_suite::mysql().await;
    let mut lock = MySqlConnection::connect(&dedup_suite::mysql_url())
        .await
        .expect("MariaDB is not reachable");
    let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK('dedup_regress_solo', 60)")
        .fetch_one(&mut lock)
        .await
        .unwrap();
    assert_eq!(locked, Some(1), "no other run holds the lock for a minute");
    execute(
        &pool,
        "DROP TABLE IF EXISTS dedup_regress_solo, dedup_regress_twin".to_owned(),
    )
    .await;
    create(&pool, "dedup_regress_solo", "dedup_regress_solo_key").await;
    let solo_key = |constraint| Outcome::Duplicate(Duplicate::BusinessKey { constraint });

    let order = dedup_suite::unique("order");
    let first = Order::new(&order, &["dedup_regress_solo"]);
    assert_eq!(solo(&pool, &first).await.unwrap(), Outcome::Processed(()));
    let second = Order::new(&order, &["dedup_regress_solo"]);
    assert_eq!(
        solo(&pool, &second).await.unwrap(),
        solo_key("dedup_regress_solo_key")
    );
    let third = Order::new(&order, &["dedup_regress_solo"]);
    assert_eq!(
        solo_qualified(&pool, &third).await.unwrap(),
        solo_key("dedup_regress_solo.dedup_regress_solo_key")
    );
    let fourth = Order::new(&order, &["dedup_regress_solo"]);
    let result = solo_elsewhere(&pool, &fourth).await;
    assert_refused(&pool, result, &fourth, "a key of another table").await;
    assert_eq!(claims(&pool, &first).await, 1);
    for msg in [&second, &third] {
        assert_eq!(claims(&pool, msg).await, 0, "a business-key duplicate");
    }
    assert_eq!(orders(&pool, "dedup_regress_solo", &order).await, 1);

    // A second table with a key of the same name: MariaDB's message cannot tell them
    // apart, so neither form matches any more.
    create(&pool, "dedup_regress_twin", "dedup_regress_solo_key").await;
    let fifth = Order::new(&order, &["dedup_regress_solo"]);
    let result = solo(&pool, &fifth).await;
    assert_refused(&pool, result, &fifth, "two tables, plain name").await;
    let sixth = Order::new(&order, &["dedup_regress_solo"]);
    let result = solo_qualified(&pool, &sixth).await;
    assert_refused(&pool, result, &sixth, "two tables, table.key").await;
    assert_eq!(orders(&pool, "dedup_regress_solo", &order).await, 1);

    execute(
        &pool,
        "DROP TABLE dedup_regress_solo, dedup_regress_twin".to_owned(),
    )
    .await;
    sqlx::query("SELECT RELEASE_LOCK('dedup_regress_solo')")
        .execute(&mut lock)
        .await
        .unwrap();
    lock.close().await.unwrap();
}
