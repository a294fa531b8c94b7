//! Issue 24, item 1: a handler without a lease — a plain `#[idempotent]` handler or a batch
//! — that met a row held in progress by a leased handler of the same consumer answered
//! `Duplicate(AlreadyProcessed)`, which means "acknowledge"; the owner's call could then
//! fail and release the row, and the message was processed nowhere. Its conflict branch
//! never read the row's state. Now every claim path reads it: in progress → the typed
//! `InProgress` (plain: the error, which `AckPolicy` retries after the lease's time left;
//! batch: `BatchItem::InProgress`, not acknowledged); a mark-first call's expired mark →
//! `Duplicate(OutcomeUnknown)`, as for a leased handler; an expired send-first lease →
//! taken over in the handler's own transaction, processed once, and the old owner's
//! completion refused (`LeaseLost`). Checked on every backend, with the effects and the
//! dedup rows read back.

use std::time::Duration;

use dedup_runtime::batch::BatchItem;
use dedup_runtime::{
    Ack, AckPolicy, Duplicate, InProgress, Lease, LeaseLost, LeaseOutcome, Outcome, idempotent,
};
use dedup_suite::{TestDatabase, unique};
use tokio::sync::Notify;

/// Holds a leased body after its external call: `entered` once there, released by `go`.
#[derive(Default)]
struct Hold {
    entered: Notify,
    go: Notify,
}

/// A message of the batch form.
struct Msg {
    id: String,
}

fn msgs(ids: &[&str]) -> Vec<Msg> {
    ids.iter()
        .map(|id| Msg {
            id: (*id).to_owned(),
        })
        .collect()
}

/// The dedup rows of `id` that are processed (`state` NULL).
async fn processed<DB: TestDatabase>(pool: &sqlx::Pool<DB>, id: &str) -> i64 {
    let [first, second] = DB::PLACEHOLDERS;
    let sql = format!(
        "SELECT COUNT(*) FROM processed_messages WHERE consumer = {first} \
         AND message_id = {second} AND state IS NULL"
    );
    DB::count(pool, sql, vec![CONSUMER.to_owned(), id.to_owned()]).await
}

const CONSUMER: &str = "regress-met-lease";

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, effects = $effects:literal,
     record = $record:literal) => {
        mod $backend {
            use super::*;

            /// Send-first under a lease: the call, held, then the result recorded.
            #[idempotent(consumer = "regress-met-lease", key = id, effect = "send-first", lease = "30s")]
            async fn leased(lease: &mut Lease<'_, $db>, id: &str, hold: &Hold) -> Result<(), sqlx::Error> {
                hold.entered.notify_one();
                hold.go.notified().await;
                let tx = lease.transaction().await?;
                sqlx::query($record).bind(id).bind("leased").execute(&mut *tx).await?;
                Ok(())
            }

            /// The same, with a lease that is over before the copy comes.
            #[idempotent(consumer = "regress-met-lease", key = id, effect = "send-first", lease = "1ms")]
            async fn leased_short(lease: &mut Lease<'_, $db>, id: &str, hold: &Hold) -> Result<(), sqlx::Error> {
                hold.entered.notify_one();
                hold.go.notified().await;
                let tx = lease.transaction().await?;
                sqlx::query($record).bind(id).bind("leased").execute(&mut *tx).await?;
                Ok(())
            }

            /// Mark-first with a lease that is over before the copy comes.
            #[idempotent(consumer = "regress-met-lease", key = id, effect = "mark-first", lease = "1ms")]
            async fn marked(_lease: &mut Lease<'_, $db>, id: &str, hold: &Hold) -> Result<(), sqlx::Error> {
                let _ = id;
                hold.entered.notify_one();
                hold.go.notified().await;
                Ok(())
            }

            #[idempotent(consumer = "regress-met-lease", key = id)]
            async fn plain(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query($record).bind(id).bind("plain").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "regress-met-lease", batch = fresh, key = |msg| msg.id.as_str())]
            async fn batch(tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    sqlx::query($record).bind(msg.id.as_str()).bind("batch").execute(&mut *tx).await?;
                }
                Ok(())
            }

            async fn effects(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "regress_met_lease_effects", "message_id", id).await
            }

            #[tokio::test]
            async fn a_copy_meeting_a_lease_in_progress_is_retried_never_acknowledged() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_suite::ddl(pool, $effects).await;
                let id = unique("regress-met-lease");
                let other = unique("regress-met-lease-other");
                let hold = Hold::default();
                let (owner, ()) = tokio::join!(leased(pool, &id, &hold), async {
                    hold.entered.notified().await;
                    // The plain handler: the typed in-progress error, retried after the
                    // time the lease has left.
                    let error = plain(pool, &id).await.expect_err("in progress, not a duplicate");
                    let busy = InProgress::find(&error).expect("the typed InProgress");
                    assert!(busy.remaining() > Duration::from_secs(20), "{busy:?}");
                    let ack = AckPolicy::<$db>::new().decide(&Err::<Outcome<()>, _>(error), 1);
                    assert!(matches!(ack, Ack::Retry { after } if after > Duration::from_secs(20)), "{ack:?}");
                    // The batch: that message in progress, not acknowledged; the other
                    // message of the batch processed.
                    let outcome = batch(pool, &msgs(&[&id, &other])).await.unwrap();
                    assert!(matches!(outcome.items()[0], BatchItem::InProgress(_)), "{outcome:?}");
                    assert!(!outcome.ack(0));
                    assert!(matches!(outcome.items()[1], BatchItem::Processed), "{outcome:?}");
                    assert_eq!(outcome.in_progress(), 1);
                    assert_eq!(effects(pool, &id).await, 0, "nothing applied beside the lease");
                    assert_eq!(processed(pool, &id).await, 0, "the row is still in progress");
                    hold.go.notify_one();
                });
                assert_eq!(owner.unwrap(), LeaseOutcome::Processed(()));
                assert_eq!(effects(pool, &id).await, 1);
                assert_eq!(effects(pool, &other).await, 1);
                assert_eq!(processed(pool, &id).await, 1);
                // Once processed: a duplicate for both.
                assert_eq!(plain(pool, &id).await.unwrap(), Outcome::Duplicate(Duplicate::AlreadyProcessed));
                let again = batch(pool, &msgs(&[&id])).await.unwrap();
                assert!(matches!(again.items()[0], BatchItem::Duplicate(Duplicate::AlreadyProcessed)));
                assert_eq!(effects(pool, &id).await, 1);
            }

            #[tokio::test]
            async fn an_expired_send_first_lease_is_taken_over_and_processed_once() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_suite::ddl(pool, $effects).await;
                for form in ["plain", "batch"] {
                    let id = unique("regress-met-expired");
                    let hold = Hold::default();
                    let (owner, ()) = tokio::join!(leased_short(pool, &id, &hold), async {
                        hold.entered.notified().await;
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        if form == "plain" {
                            assert_eq!(plain(pool, &id).await.unwrap(), Outcome::Processed(()));
                        } else {
                            let outcome = batch(pool, &msgs(&[&id])).await.unwrap();
                            assert!(matches!(outcome.items()[0], BatchItem::Processed), "{outcome:?}");
                        }
                        assert_eq!(processed(pool, &id).await, 1, "{form}: processed by the copy");
                        hold.go.notify_one();
                    });
                    // The old owner's completion is refused: its result never commits.
                    let lost = owner.expect_err("the old owner's lease was taken over");
                    assert!(LeaseLost::find(&lost).is_some(), "{form}: {lost}");
                    assert_eq!(effects(pool, &id).await, 1, "{form}: the effect once");
                    assert_eq!(processed(pool, &id).await, 1);
                    assert_eq!(plain(pool, &id).await.unwrap(), Outcome::Duplicate(Duplicate::AlreadyProcessed));
                }
            }

            #[tokio::test]
            async fn an_expired_mark_first_mark_is_an_unknown_outcome() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_suite::ddl(pool, $effects).await;
                let id = unique("regress-met-unknown");
                let hold = Hold::default();
                let (owner, ()) = tokio::join!(marked(pool, &id, &hold), async {
                    hold.entered.notified().await;
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    assert_eq!(plain(pool, &id).await.unwrap(), Outcome::Duplicate(Duplicate::OutcomeUnknown));
                    let outcome = batch(pool, &msgs(&[&id])).await.unwrap();
                    assert!(
                        matches!(outcome.items()[0], BatchItem::Duplicate(Duplicate::OutcomeUnknown)),
                        "{outcome:?}"
                    );
                    assert_eq!(effects(pool, &id).await, 0, "nothing called again");
                    assert_eq!(processed(pool, &id).await, 0, "still unresolved");
                    hold.go.notify_one();
                });
                // Nobody took the mark over: its owner completes it.
                assert_eq!(owner.unwrap(), LeaseOutcome::Processed(()));
                assert_eq!(processed(pool, &id).await, 1);
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_met_lease_effects \
               (message_id text NOT NULL, by_whom text NOT NULL)",
    record = "INSERT INTO regress_met_lease_effects (message_id, by_whom) VALUES ($1, $2)"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_met_lease_effects \
               (message_id VARBINARY(255) NOT NULL, by_whom VARCHAR(16) NOT NULL) ENGINE = InnoDB",
    record = "INSERT INTO regress_met_lease_effects (message_id, by_whom) VALUES (?, ?)"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    effects = "CREATE TABLE IF NOT EXISTS regress_met_lease_effects \
               (message_id TEXT NOT NULL, by_whom TEXT NOT NULL)",
    record = "INSERT INTO regress_met_lease_effects (message_id, by_whom) VALUES (?1, ?2)"
);
