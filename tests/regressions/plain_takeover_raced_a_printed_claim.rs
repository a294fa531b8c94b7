//! Issue 39, item 4, the race its take-overs left open: on PostgreSQL a plain handler
//! with `fingerprint = …` reads the row it found (an expired send-first lease, claimed
//! without a fingerprint) with plain reads, which lock nothing, and takes it over with a
//! statement of its own. Between the two, another delivery of the same id with another
//! payload took the row over under a lease of its own and printed it; once that lease was
//! over too, the plain take-over, whose WHERE checked `state` and `expires_at` but no
//! fingerprint, took the row: the handler processed its payload over a row printed with
//! another, the mismatch unreported, and robbed the other delivery of its lease. The plain
//! take-over now refuses a row printed with another fingerprint, as the leased and the
//! batch take-overs do, and the handler looks again and reports the mismatch.
//!
//! The steps are ordered by row locks, nothing by sleeps: a test transaction holds the
//! row (`FOR UPDATE`), the other delivery's take-over queues for it, a second test
//! transaction queues behind that one, and the plain handler, whose reads do not wait,
//! queues its take-over last. The first release lets the other take-over commit; the
//! second, once its lease is over on the database's clock, lets the plain take-over run.
//!
//! PostgreSQL only: on MariaDB/MySQL the claim's failed insert and the reads before the
//! take-over (`LOCK IN SHARE MODE`) hold the row until the handler's transaction ends,
//! and SQLite's handler transaction holds the write lock from its claim (`BEGIN
//! IMMEDIATE` in its own transaction; the claim's insert inside a caller's): nothing
//! changes the row between its read and its take-over there.

use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::{FingerprintMismatch, Lease, LeaseOutcome, fingerprint, idempotent};
use dedup_suite::{Gate, unique};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, Postgres};
use sqlx::{Connection as _, Pool};

const CONSUMER: &str = "regress-plain-race";
/// Whose sessions are whose in `pg_stat_activity`.
const HANDLER_APP: &str = "regress-plain-race-handler";
const OTHER_APP: &str = "regress-plain-race-other";
/// How long a step may take before the test says which one hung.
const STEP: Duration = Duration::from_secs(20);

/// A delivery: its id and its payload.
#[derive(Debug, Clone)]
struct Msg {
    id: String,
    payload: Vec<u8>,
}

/// The first delivery: send-first under a lease, no fingerprint (a version of before
/// `fingerprint = …`). Its owner dies at the gate.
#[idempotent(consumer = "regress-plain-race", key = msg.id, effect = "send-first", lease = "30s")]
async fn unprinted(
    _lease: &mut Lease<'_, Postgres>,
    msg: &Msg,
    gate: &Gate,
) -> Result<(), sqlx::Error> {
    let _ = msg;
    gate.pass().await;
    Ok(())
}

/// The other delivery: leased, printed, a short lease; it stalls at the gate while its
/// lease runs out.
#[idempotent(consumer = "regress-plain-race", key = msg.id, effect = "send-first", lease = "50ms", fingerprint = msg.payload)]
async fn other(
    _lease: &mut Lease<'_, Postgres>,
    msg: &Msg,
    gate: &Gate,
) -> Result<(), sqlx::Error> {
    let _ = msg;
    gate.pass().await;
    Ok(())
}

/// The plain handler with a fingerprint.
#[idempotent(consumer = "regress-plain-race", key = msg.id, fingerprint = msg.payload)]
async fn plain(tx: &mut PgConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO regress_plain_race_effects (message_id) VALUES ($1)")
        .bind(&msg.id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// A pool whose sessions say `application_name`.
async fn pool_named(application_name: &str) -> PgPool {
    let options = PgConnectOptions::from_str(&dedup_suite::postgres_url())
        .unwrap()
        .application_name(application_name);
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap()
}

/// A session of its own for one of the test's transactions, and its pid.
async fn session() -> (PgConnection, i32) {
    let mut conn = PgConnection::connect(&dedup_suite::postgres_url())
        .await
        .unwrap();
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    (conn, pid)
}

/// Begins a transaction on `conn` that holds the row of `id` (`FOR UPDATE`), waiting for
/// it if another holds it; the test ends it with a `COMMIT`.
async fn hold(conn: &mut PgConnection, id: &str) {
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query(
        "SELECT 1 FROM processed_messages WHERE consumer = $1 AND message_id = $2 FOR UPDATE",
    )
    .bind(CONSUMER)
    .bind(id)
    .execute(&mut *conn)
    .await
    .unwrap();
}

/// Waits until a session (of `application_name`, or with `pid`) waits for a lock in an
/// `UPDATE` (or, for a pid, in anything).
async fn until_waiting(
    pool: &PgPool,
    application_name: Option<&str>,
    pid: Option<i32>,
    what: &str,
) {
    let waiting = async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND (application_name = $1 AND query LIKE 'UPDATE %' OR pid = $2)",
            )
            .bind(application_name)
            .bind(pid)
            .fetch_one(pool)
            .await
            .unwrap();
            if waiting > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(STEP, waiting)
        .await
        .unwrap_or_else(|_| panic!("{what} never waited for the row"));
}

/// The row of `id`: its `state`, its fingerprint, whether its lease is over (on the
/// database's clock).
async fn row(pool: &PgPool, id: &str) -> (Option<i16>, Option<Vec<u8>>, bool) {
    sqlx::query_as(
        "SELECT state, fingerprint, coalesce(expires_at <= clock_timestamp(), false) \
         FROM processed_messages WHERE consumer = $1 AND message_id = $2",
    )
    .bind(CONSUMER)
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn effects(pool: &Pool<Postgres>, id: &str) -> i64 {
    dedup_suite::rows(pool, "regress_plain_race_effects", "message_id", id).await
}

#[tokio::test]
async fn a_plain_take_over_refuses_a_row_printed_after_its_read() {
    let pool = dedup_suite::postgres().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS regress_plain_race_effects (message_id text NOT NULL)",
    )
    .await;
    let id = unique("plain-race");
    let first = Msg {
        id: id.clone(),
        payload: b"one".to_vec(),
    };
    let mine = Msg {
        payload: b"two".to_vec(),
        ..first.clone()
    };
    let theirs = Msg {
        payload: b"three".to_vec(),
        ..first.clone()
    };

    // The row: claimed under a send-first lease without a fingerprint, its owner dead,
    // the lease over.
    let gate = Gate::held();
    let dead = {
        let (pool, msg, gate) = (pool.clone(), first.clone(), Arc::clone(&gate));
        tokio::spawn(async move { unprinted(&pool, &msg, &gate).await.map(drop) })
    };
    gate.entered.notified().await;
    dead.abort();
    assert!(dead.await.unwrap_err().is_cancelled());
    sqlx::query(
        "UPDATE processed_messages SET expires_at = clock_timestamp() - interval '1 second' \
         WHERE consumer = $1 AND message_id = $2",
    )
    .bind(CONSUMER)
    .bind(&id)
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(row(&pool, &id).await, (Some(1), None, true));

    let (mut holder, _) = session().await;
    hold(&mut holder, &id).await;

    // The other delivery reads the row and queues its take-over first.
    let other_pool = pool_named(OTHER_APP).await;
    let their_gate = Gate::held();
    let theirs_task = {
        let (pool, msg, gate) = (other_pool.clone(), theirs.clone(), Arc::clone(&their_gate));
        tokio::spawn(async move { other(&pool, &msg, &gate).await })
    };
    until_waiting(&pool, Some(OTHER_APP), None, "the other take-over").await;

    // A second test transaction queues behind it.
    let (mut second, second_pid) = session().await;
    let second_task = {
        let id = id.clone();
        tokio::spawn(async move {
            hold(&mut second, &id).await;
            second
        })
    };
    until_waiting(&pool, None, Some(second_pid), "the second test transaction").await;

    // The plain handler reads the row (no fingerprint yet) and queues its take-over last.
    let handler_pool = pool_named(HANDLER_APP).await;
    let mine_task = {
        let (pool, msg) = (handler_pool.clone(), mine.clone());
        tokio::spawn(async move { plain(&pool, &msg).await })
    };
    until_waiting(&pool, Some(HANDLER_APP), None, "the plain take-over").await;

    // The other take-over commits (printed, a lease of its own) and its body stalls;
    // the second transaction holds the row until that lease is over.
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    tokio::time::timeout(STEP, their_gate.entered.notified())
        .await
        .expect("the other delivery took the row over");
    let mut second = tokio::time::timeout(STEP, second_task)
        .await
        .expect("the second test transaction got the row")
        .unwrap();
    let expired = async {
        while !row(&pool, &id).await.2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(STEP, expired)
        .await
        .expect("the lease ran out");
    assert_eq!(
        row(&pool, &id).await,
        (Some(1), Some(fingerprint(b"three").to_vec()), true),
        "printed by the other delivery"
    );

    // Now the plain take-over runs.
    sqlx::raw_sql("COMMIT").execute(&mut second).await.unwrap();
    let outcome = tokio::time::timeout(STEP, mine_task)
        .await
        .expect("the plain handler ended")
        .unwrap();
    let error = outcome.expect_err("a mismatch, not taken over");
    let mismatch =
        FingerprintMismatch::find(&error).unwrap_or_else(|| panic!("not a mismatch: {error:?}"));
    assert_eq!(mismatch.stored(), fingerprint(b"three"));
    assert_eq!(mismatch.received(), fingerprint(b"two"));
    assert_eq!(effects(&pool, &id).await, 0, "the plain body never ran");
    assert_eq!(
        row(&pool, &id).await,
        (Some(1), Some(fingerprint(b"three").to_vec()), true),
        "the row is the other delivery's still"
    );

    // The other delivery, let go, completes its own row.
    their_gate.go.notify_one();
    let outcome = tokio::time::timeout(STEP, theirs_task)
        .await
        .expect("the other delivery ended")
        .unwrap()
        .expect("its lease was its own");
    assert!(
        matches!(outcome, LeaseOutcome::Processed(())),
        "{outcome:?}"
    );
    assert_eq!(
        row(&pool, &id).await.0,
        None,
        "processed by the other delivery"
    );
}
