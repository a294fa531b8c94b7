//! Leases, on every backend: mark-first, and send-first with a lease. A leased send-first
//! call runs once, with no transaction open and the connection back in the pool, its
//! result recorded in the completion's transaction; a concurrent copy is in progress, with
//! the time left; a crash after the call repeats it after the lease, with a new owner; a
//! stale owner is refused and changes nothing; renewal keeps a long call; a body error
//! releases the lease. Mark-first runs once; a crash before its call is lost, and visible;
//! the operator resolves only ended leases. `leases_suite!` instantiates the cases once
//! per backend, with that backend's faults; PostgreSQL's `pg_stat_activity` shows no
//! transaction open during a leased call.

use std::sync::Arc;

use dedup_runtime::{Duplicate, idempotent};
use dedup_suite::{claims, unique};
use tokio::sync::Notify;
use tokio::time::timeout;

use super::*;

/// The row of `(consumer, id)`: its `state` (NULL processed, 1 a send-first lease, 2 a
/// mark-first mark) and its owner token, or `None` when there is none.
async fn lease_row<DB>(
    pool: &sqlx::Pool<DB>,
    consumer: &str,
    id: &str,
) -> Option<(Option<i64>, Option<Vec<u8>>)>
where
    DB: sqlx::Database,
    for<'e> &'e sqlx::Pool<DB>: sqlx::Executor<'e, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (Option<i64>, Option<Vec<u8>>): sqlx::FromRow<'r, DB::Row>,
{
    let sql = if DB::NAME == "PostgreSQL" {
        "SELECT state::int8, owner FROM processed_messages WHERE consumer = $1 AND message_id = $2"
    } else {
        "SELECT CAST(state AS SIGNED), owner FROM processed_messages WHERE consumer = ? AND message_id = ?"
    };
    let sql = if DB::NAME == "SQLite" {
        "SELECT state, owner FROM processed_messages WHERE consumer = ? AND message_id = ?"
    } else {
        sql
    };
    sqlx::query_as(sql)
        .bind(consumer)
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Holds a leased body at one point: `entered` once it got there, released by `go`.
#[derive(Debug, Default)]
struct Hold {
    entered: Notify,
    go: Notify,
}

impl Hold {
    async fn here(hold: Option<&Hold>) {
        if let Some(hold) = hold {
            hold.entered.notify_one();
            hold.go.notified().await;
        }
    }
}

macro_rules! leases_suite {
    ($backend:ident, db = $db:ty, faults = $faults:ident $(,)?) => {
        mod $backend {
            use super::*;
            use super::$faults as faults;
            use dedup_runtime::{Lease, LeaseLost, LeaseOutcome, Resolution, UnresolvedStatus};

            const SEND: &str = "leases-send-first";
            const MARK: &str = "leases-mark-first";

            /// The charge: one call with no transaction open; `before` holds it before the
            /// call, `after` between the call and the completion; the result is recorded
            /// in the completion's transaction.
            #[idempotent(consumer = "leases-send-first", key = id, effect = "send-first", lease = "30s")]
            async fn charge(
                lease: &mut Lease<'_, $db>,
                id: &str,
                provider: &Provider,
                after: Option<&Hold>,
                fail: bool,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                Hold::here(after).await;
                if fail {
                    return Err(sqlx::Error::Protocol("the provider said no".into()));
                }
                let tx = lease.transaction().await?;
                sqlx::query(faults::RECORD).bind(id).bind(call as i64).execute(&mut *tx).await?;
                Ok(call)
            }

            /// The audit ping that must never repeat: marked first, then called.
            #[idempotent(consumer = "leases-mark-first", key = id, effect = "mark-first", lease = "30s")]
            async fn ping(
                lease: &mut Lease<'_, $db>,
                id: &str,
                provider: &Provider,
                before: Option<&Hold>,
                fail: bool,
            ) -> Result<u32, sqlx::Error> {
                Hold::here(before).await;
                if fail {
                    return Err(sqlx::Error::Protocol("the audit service is down".into()));
                }
                Ok(provider.call().await)
            }

            /// A long call under a short lease, renewed every quarter of it.
            #[idempotent(consumer = "leases-renewed", key = id, effect = "send-first", lease = "1s")]
            async fn long_call(
                lease: &mut Lease<'_, $db>,
                id: &str,
                provider: &Provider,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                for _ in 0..12 {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    lease.extend().await?;
                }
                Ok(call)
            }

            /// Starts `charge` (or, `marked`, `ping`) in a task of its own, and waits until
            /// its body reaches `hold`: after the call (`charge`), before it (`ping`).
            async fn held(
                marked: bool,
                pool: &sqlx::Pool<$db>,
                id: &str,
                provider: &Arc<Provider>,
                hold: &Arc<Hold>,
            ) -> tokio::task::JoinHandle<Result<LeaseOutcome<u32>, sqlx::Error>> {
                let task = tokio::spawn({
                    let (pool, id, provider, hold) = (pool.clone(), id.to_owned(), provider.clone(), hold.clone());
                    async move {
                        if marked {
                            ping(&pool, &id, &provider, Some(&hold), false).await
                        } else {
                            charge(&pool, &id, &provider, Some(&hold), false).await
                        }
                    }
                });
                timeout(PATIENCE, hold.entered.notified()).await.expect("the body reached its hold");
                task
            }

            async fn recorded(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "dedup_lease_results", "message_id", id).await
            }

            #[tokio::test]
            async fn send_first_with_a_lease_runs_once_and_records_in_the_completion() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-once");
                let provider = Provider::default();
                let first = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(first, LeaseOutcome::Processed(1));
                assert_eq!(lease_row(&*pool, SEND, &id).await.map(|row| row.0), Some(None));
                assert_eq!(recorded(&*pool, &id).await, 1);
                let again = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(again, LeaseOutcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 1);
                assert_eq!(recorded(&*pool, &id).await, 1);
            }

            /// No transaction and no connection are held while the call runs.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_call_runs_with_the_connection_back_in_the_pool() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-pool");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(false, &pool, &id, &provider, &hold).await;
                // A connection dropped goes back to the pool through a task of its own.
                timeout(PATIENCE, async {
                    while pool.num_idle() as u32 != pool.size() {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await
                .expect("every connection is back in the pool, idle, while the call runs");
                // The row is committed in progress: another connection sees it.
                assert_eq!(lease_row(&*pool, SEND, &id).await.map(|row| row.0), Some(Some(1)));
                hold.go.notify_one();
                let done = timeout(PATIENCE, task).await.unwrap().unwrap().unwrap();
                assert_eq!(done, LeaseOutcome::Processed(1));
            }

            /// Two copies at once: one call; the other is told "in progress", with the
            /// time left, neither a duplicate nor an error.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_concurrent_copy_is_in_progress_with_the_time_left() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-copies");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let first = held(false, &pool, &id, &provider, &hold).await;
                let second = charge(&*pool, &id, &provider, None, false).await.unwrap();
                let busy = second.in_progress().expect("in progress");
                assert!(busy.remaining() > Duration::from_secs(20) && busy.remaining() <= Duration::from_secs(30), "{busy:?}");
                let policy = dedup_runtime::AckPolicy::<$db>::new();
                assert_eq!(
                    policy.decide(&Ok::<_, sqlx::Error>(second), 1),
                    dedup_runtime::Ack::Retry { after: busy.remaining() }
                );
                hold.go.notify_one();
                assert_eq!(timeout(PATIENCE, first).await.unwrap().unwrap().unwrap(), LeaseOutcome::Processed(1));
                assert_eq!(provider.calls(), 1, "one call for two copies");
                assert_eq!(recorded(&*pool, &id).await, 1);
            }

            /// The documented send-first duplicate, with a lease: the owner dies after the
            /// call. Until the lease ends a redelivery is "in progress"; then it takes
            /// over with a new token and calls again. The expiry compares on the server:
            /// the test moves the row's `expires_at` into the past, the host clock stays.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_crash_after_the_call_repeats_it_after_the_lease_with_a_new_owner() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-crash");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(false, &pool, &id, &provider, &hold).await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                let (state, dead_owner) = lease_row(&*pool, SEND, &id).await.expect("the lease stays");
                assert_eq!(state, Some(1));
                assert!(charge(&*pool, &id, &provider, None, false).await.unwrap().is_in_progress());
                assert_eq!(provider.calls(), 1);

                faults::expire(&*pool, SEND, &id).await;
                let redelivered = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(redelivered, LeaseOutcome::Processed(2), "the duplicate call send-first allows");
                let (state, owner) = lease_row(&*pool, SEND, &id).await.unwrap();
                assert_eq!(state, None);
                assert_ne!(owner, dead_owner, "taken over with a new token");
                assert_eq!(recorded(&*pool, &id).await, 1);
            }

            /// A stale owner (paused past its lease) resumes after another delivery took
            /// over and completed: its completion is refused, its writes rolled back.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stale_owner_is_refused_and_changes_nothing() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-stale");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let stale = held(false, &pool, &id, &provider, &hold).await;
                faults::expire(&*pool, SEND, &id).await;
                let taken = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(taken, LeaseOutcome::Processed(2));
                let after_takeover = lease_row(&*pool, SEND, &id).await;

                hold.go.notify_one();
                let error = timeout(PATIENCE, stale).await.unwrap().unwrap().unwrap_err();
                let lost = LeaseLost::find(&error).expect("a typed LeaseLost");
                assert_eq!(lost.message_id(), id);
                assert_eq!(lease_row(&*pool, SEND, &id).await, after_takeover, "nothing changed");
                assert_eq!(recorded(&*pool, &id).await, 1, "the stale owner's write was rolled back");
                // Another delivery owns the message now: redeliver (a duplicate, then), never
                // dead-letter.
                assert!(matches!(
                    dedup_runtime::AckPolicy::<$db>::new().decide(&Err::<LeaseOutcome<u32>, _>(error), 1),
                    dedup_runtime::Ack::Retry { .. }
                ));
            }

            /// Renewal keeps a call three times as long as its lease owned.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_keeps_a_call_longer_than_its_lease_owned() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-renewed");
                let provider = Arc::new(Provider::default());
                let owner = tokio::spawn({
                    let (pool, id, provider) = ((*pool).clone(), id.clone(), provider.clone());
                    async move { long_call(&pool, &id, &provider).await }
                });
                for _ in 0..3 {
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    let copy = long_call(&*pool, &id, &provider).await.unwrap();
                    assert!(copy.is_in_progress(), "{copy:?}");
                }
                let done = timeout(PATIENCE, owner).await.unwrap().unwrap().unwrap();
                assert_eq!(done, LeaseOutcome::Processed(1));
                assert_eq!(provider.calls(), 1);
            }

            /// A body error releases the row: the redelivery runs again at once.
            #[tokio::test]
            async fn a_body_error_releases_the_lease() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-error");
                let provider = Provider::default();
                assert!(charge(&*pool, &id, &provider, None, true).await.is_err());
                assert_eq!(lease_row(&*pool, SEND, &id).await, None);
                assert_eq!(charge(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(2));
                let id = unique("mark-error");
                assert!(ping(&*pool, &id, &provider, None, true).await.is_err());
                assert_eq!(lease_row(&*pool, MARK, &id).await, None, "mark-first releases too");
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(3));
            }

            #[tokio::test]
            async fn mark_first_runs_once_then_duplicate() {
                let pool = faults::lease_pool().await;
                let id = unique("mark-once");
                let provider = Provider::default();
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(1));
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(None));
                assert!(ping(&*pool, &id, &provider, None, false).await.unwrap().is_duplicate());
                assert_eq!(provider.calls(), 1);
            }

            /// The documented mark-first loss: the process dies after the mark committed
            /// and before the call. While the lease runs, a copy is in progress; after it,
            /// the outcome is unknown: acknowledged without a call, and the row stays.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mark_first_crash_before_the_call_is_lost_and_visible() {
                let pool = faults::lease_pool().await;
                let id = unique("mark-crash");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(true, &pool, &id, &provider, &hold).await;
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(Some(2)), "the mark is committed");
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                assert!(ping(&*pool, &id, &provider, None, false).await.unwrap().is_in_progress());

                faults::expire(&*pool, MARK, &id).await;
                let redelivered = ping(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(redelivered, LeaseOutcome::Duplicate(Duplicate::OutcomeUnknown));
                assert_eq!(
                    dedup_runtime::AckPolicy::<$db>::new().decide(&Ok::<_, sqlx::Error>(redelivered), 1),
                    dedup_runtime::Ack::Ack,
                    "at most once: acknowledged"
                );
                assert_eq!(provider.calls(), 0, "the documented loss: never called");
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(Some(2)), "the row stays");

                // The operator's view: listed as unknown, and resolved.
                let ledger = dedup_runtime::Ledger::new(&*pool);
                let listed = ledger.unresolved(MARK, 10_000).await.unwrap();
                let row = listed.iter().find(|row| row.message_id() == id).expect("listed");
                assert_eq!(row.status(), UnresolvedStatus::OutcomeUnknown);
                assert!(ledger.resolve(MARK, id.as_str(), Resolution::Done).await.unwrap());
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(None), "processed");
                assert!(!ledger.resolve(MARK, id.as_str(), Resolution::Retry).await.unwrap(), "nothing left to resolve");
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 0);
            }

            /// The operator leaves a running lease alone, and sees it in progress; a
            /// retry resolution of an unknown row runs the handler at the next delivery.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_operator_lists_and_resolves_only_ended_leases() {
                let pool = faults::lease_pool().await;
                let id = unique("mark-operator");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(true, &pool, &id, &provider, &hold).await;
                let ledger = dedup_runtime::Ledger::new(&*pool);
                let listed = ledger.unresolved(MARK, 10_000).await.unwrap();
                let row = listed.iter().find(|row| row.message_id() == id).expect("listed");
                assert!(matches!(row.status(), UnresolvedStatus::InProgress { remaining } if remaining > Duration::from_secs(20)), "{row:?}");
                assert!(!ledger.resolve(MARK, id.as_str(), Resolution::Retry).await.unwrap(), "a running lease is left alone");
                task.abort();
                let _ = task.await;
                faults::expire(&*pool, MARK, &id).await;
                assert!(ledger.resolve(MARK, id.as_str(), Resolution::Retry).await.unwrap());
                assert_eq!(lease_row(&*pool, MARK, &id).await, None);
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(1), "replayed");

                // An abandoned send-first lease is listed as such.
                let id = unique("lease-operator");
                let task = held(false, &pool, &id, &provider, &hold).await;
                task.abort();
                let _ = task.await;
                faults::expire(&*pool, SEND, &id).await;
                let listed = ledger.unresolved(SEND, 10_000).await.unwrap();
                let row = listed.iter().find(|row| row.message_id() == id).expect("listed");
                assert_eq!(row.status(), UnresolvedStatus::LeaseExpired);
            }
        }
    };
}

/// PostgreSQL's own view while a leased call runs: no session of the handler's pool is in a
/// transaction (`pg_stat_activity`, read from another pool), and every connection of it is
/// idle in the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_shows_no_transaction_open_during_a_leased_call() {
    use dedup_runtime::{Lease, LeaseOutcome};
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    /// Renews its lease (a statement on a connection of the pool, then back), then calls.
    #[idempotent(consumer = "leases-activity", key = id, effect = "send-first", lease = "30s")]
    async fn call_out(
        lease: &mut Lease<'_, sqlx::Postgres>,
        id: &str,
        hold: &Hold,
    ) -> Result<(), sqlx::Error> {
        lease.extend().await?;
        Hold::here(Some(hold)).await;
        Ok(())
    }

    let name = unique("dedup-lease-activity");
    let options: PgConnectOptions = dedup_suite::postgres_url().parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&name))
        .await
        .unwrap();
    let observer = dedup_suite::postgres().await;
    let id = unique("lease-activity");
    let hold = Arc::new(Hold::default());
    let task = tokio::spawn({
        let (pool, id, hold) = (pool.clone(), id.clone(), hold.clone());
        async move { call_out(&pool, &id, &hold).await }
    });
    timeout(PATIENCE, hold.entered.notified())
        .await
        .expect("the call runs");
    let count = |sql: &'static str| {
        let (observer, name) = (observer.clone(), name.clone());
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .bind(name)
                .fetch_one(&observer)
                .await
                .unwrap()
        }
    };
    let sessions = count("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1").await;
    assert!(sessions >= 1, "the handler's pool has its sessions open");
    let in_transaction = count(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 \
         AND (xact_start IS NOT NULL OR state LIKE 'idle in transaction%')",
    )
    .await;
    assert_eq!(
        in_transaction, 0,
        "no session of the handler is in a transaction during the call"
    );
    timeout(PATIENCE, async {
        while pool.num_idle() as u32 != pool.size() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the pool has every connection back during the call");
    hold.go.notify_one();
    let done = timeout(PATIENCE, task).await.unwrap().unwrap().unwrap();
    assert_eq!(done, LeaseOutcome::Processed(()));
    assert_eq!(claims(&pool, "leases-activity", &id).await, 1);
}

leases_suite!(
    postgres_leases,
    db = sqlx::Postgres,
    faults = postgres_faults
);
leases_suite!(mysql_leases, db = sqlx::MySql, faults = mysql_faults);
leases_suite!(sqlite_leases, db = sqlx::Sqlite, faults = sqlite_faults);
