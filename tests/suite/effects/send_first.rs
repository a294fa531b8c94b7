//! `effect = "send-first"` on every backend (issue 11, its first step): a body whose
//! effect is outside the database (an email, an HTTP call) may leave its connection
//! unused; the call happens before the processed mark commits; a crash between the two
//! repeats the call on redelivery (the documented duplicate); a concurrent copy waits on
//! the claim; and nothing re-runs a body after it ran — a transient failure at `COMMIT` or
//! from the body, or a transaction the database rolled back by itself, is the caller's
//! error, where a handler without `effect` runs the whole transaction again.
//!
//! `effects_suite!` instantiates the cases once per backend, with that backend's faults.

use std::sync::Arc;

use dedup_runtime::{Duplicate, MAX_ATTEMPTS, Outcome, RolledBack, idempotent};
use dedup_suite::{claims, claims_in, error_code, unique};
use tokio::sync::Notify;
use tokio::time::timeout;

use super::*;

/// Holds a body after its call: `entered` once it got there, released by `go`.
#[derive(Debug, Default)]
struct Gate {
    entered: Notify,
    go: Notify,
}

macro_rules! effects_suite {
    ($backend:ident, conn = $conn:ty, faults = $faults:ident $(,)?) => {
        mod $backend {
            use super::*;
            use super::$faults as faults;

            const CONSUMER: &str = "effects-send-first";

            /// The receipt email: one call, the connection never touched. With a gate it
            /// stops after the call until the gate opens.
            #[idempotent(consumer = "effects-send-first", key = id, effect = "send-first")]
            async fn send(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                gate: Option<&Gate>,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if let Some(gate) = gate {
                    gate.entered.notify_one();
                    gate.go.notified().await;
                }
                Ok(call)
            }

            #[tokio::test]
            async fn runs_once_without_the_connection_then_duplicate() {
                let pool = faults::pool().await;
                let id = unique("send-first");
                let provider = Provider::default();
                assert_eq!(send(&*pool, &id, &provider, None).await.unwrap(), Outcome::Processed(1));
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                let again = send(&*pool, &id, &provider, None).await.unwrap();
                assert_eq!(again, Outcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 1, "a duplicate calls nobody");
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
            }

            /// The documented duplicate: the call was made, then the call of the handler
            /// ends (the process dies) before its `COMMIT`.
            #[tokio::test]
            async fn crash_between_the_call_and_the_commit_repeats_the_call() {
                let pool = faults::pool().await;
                let id = unique("send-first-crash");
                let provider = Arc::new(Provider::default());
                let gate = Arc::new(Gate::default());
                let task = tokio::spawn({
                    let (pool, id) = ((*pool).clone(), id.clone());
                    let (provider, gate) = (provider.clone(), gate.clone());
                    async move { send(&pool, &id, &provider, Some(&gate)).await }
                });
                timeout(PATIENCE, gate.entered.notified())
                    .await
                    .expect("the body made its call");
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                assert_eq!(provider.calls(), 1);
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 0, "no mark without the COMMIT");

                // The redelivery calls again — the duplicate send-first allows — and marks.
                let redelivered = timeout(PATIENCE, send(&*pool, &id, &provider, None))
                    .await
                    .expect("the redelivery is not blocked by the dead call's transaction");
                assert_eq!(redelivered.unwrap(), Outcome::Processed(2));
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                assert!(send(&*pool, &id, &provider, None).await.unwrap().is_duplicate());
                assert_eq!(provider.calls(), 2);
            }

            /// While the first copy's call runs, the second waits on its claim; once the
            /// first commits, the second is a duplicate and calls nobody.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_concurrent_copy_waits_on_the_claim_then_is_a_duplicate() {
                let pool = faults::pool().await;
                let id = unique("send-first-copies");
                let provider = Arc::new(Provider::default());
                let gate = Arc::new(Gate::default());
                // Both copies get the gate: a second copy that ran its body would stop there.
                let copy = || {
                    let (pool, id) = ((*pool).clone(), id.clone());
                    let (provider, gate) = (provider.clone(), gate.clone());
                    tokio::spawn(async move { send(&pool, &id, &provider, Some(&gate)).await })
                };
                let first = copy();
                timeout(PATIENCE, gate.entered.notified())
                    .await
                    .expect("the first copy made its call");
                let second = copy();
                tokio::time::sleep(Duration::from_millis(300)).await;
                assert!(!second.is_finished(), "the second copy waits on the first one's claim");
                assert_eq!(provider.calls(), 1);

                gate.go.notify_one();
                let first = timeout(PATIENCE, first).await.expect("the first copy ends");
                assert_eq!(first.unwrap().unwrap(), Outcome::Processed(1));
                let second = timeout(PATIENCE, second).await.expect("the second copy ends");
                let second = second.unwrap().unwrap();
                assert_eq!(second, Outcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 1, "one call for two copies");
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
            }

            // ---- no retry once the body ran ---------------------------------------------

            /// Calls, then on its first `failures` calls the database raises a transient
            /// error (a serialization failure, a deadlock, `SQLITE_LOCKED`).
            #[idempotent(consumer = "effects-body-transient", key = id, effect = "send-first")]
            async fn send_then_fail(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                failures: u32,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call <= failures {
                    faults::raise_transient(tx).await?;
                }
                Ok(call)
            }

            /// The same body without `effect`.
            #[idempotent(consumer = "effects-body-transient-plain", key = id)]
            async fn plain_then_fail(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                failures: u32,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call <= failures {
                    faults::raise_transient(tx).await?;
                }
                Ok(call)
            }

            #[tokio::test]
            async fn a_transient_error_after_the_call_is_returned_not_retried() {
                let pool = faults::pool().await;
                let id = unique("send-first-transient");
                let provider = Provider::default();
                let error = send_then_fail(&*pool, &id, &provider, 1).await.unwrap_err();
                assert_eq!(error_code(&error).as_deref(), Some(faults::TRANSIENT_CODE), "{error:?}");
                assert_eq!(provider.calls(), 1, "no second call behind the caller's back");
                assert_eq!(claims(&*pool, "effects-body-transient", &id).await, 0);
                // The caller's redelivery calls again, visibly, and commits.
                let redelivered = send_then_fail(&*pool, &id, &provider, 1).await.unwrap();
                assert_eq!(redelivered, Outcome::Processed(2));
                assert_eq!(claims(&*pool, "effects-body-transient", &id).await, 1);

                // Without `effect` the same failure runs the body again inside the call.
                let id = unique("plain-transient");
                let provider = Provider::default();
                let outcome = plain_then_fail(&*pool, &id, &provider, 1).await.unwrap();
                assert_eq!(outcome, Outcome::Processed(2));
                assert_eq!(provider.calls(), 2, "retried: the body ran twice");
                assert_eq!(claims(&*pool, "effects-body-transient-plain", &id).await, 1);
            }

            /// Calls; on its first call makes this transaction's `COMMIT` fail with a
            /// transient error, on later ones lets commits through again.
            #[idempotent(
                consumer = "effects-commit",
                key = id,
                table = "dedup_effects_commit",
                effect = "send-first"
            )]
            async fn send_then_commit(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                fault: &faults::CommitFault,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call == 1 {
                    fault.arm(tx, id).await?;
                } else {
                    fault.disarm().await;
                }
                Ok(call)
            }

            /// The same body without `effect`.
            #[idempotent(consumer = "effects-commit-plain", key = id, table = "dedup_effects_commit")]
            async fn plain_then_commit(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                fault: &faults::CommitFault,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call == 1 {
                    fault.arm(tx, id).await?;
                } else {
                    fault.disarm().await;
                }
                Ok(call)
            }

            #[tokio::test]
            async fn a_transient_failure_at_commit_is_returned_not_retried() {
                let db = faults::commit_fault_db().await;
                let fault = faults::CommitFault::new(&db).await;
                let id = unique("send-first-commit");
                let provider = Provider::default();
                let error = timeout(PATIENCE, send_then_commit(&*db, &id, &provider, &fault))
                    .await
                    .expect("the call returns")
                    .unwrap_err();
                assert_eq!(error_code(&error).as_deref(), Some(faults::COMMIT_CODE), "{error:?}");
                assert_eq!(provider.calls(), 1, "the COMMIT failed after the call: no second call");
                assert_eq!(claims_in(&*db, COMMIT_TABLE, "effects-commit", &id).await, 0);
                fault.disarm().await;
                let redelivered = send_then_commit(&*db, &id, &provider, &fault).await.unwrap();
                assert_eq!(redelivered, Outcome::Processed(2));
                assert_eq!(claims_in(&*db, COMMIT_TABLE, "effects-commit", &id).await, 1);

                // Without `effect` the failed COMMIT runs the whole transaction again.
                let id = unique("plain-commit");
                let provider = Provider::default();
                let outcome = timeout(PATIENCE, plain_then_commit(&*db, &id, &provider, &fault))
                    .await
                    .expect("the call returns")
                    .unwrap();
                assert_eq!(outcome, Outcome::Processed(2));
                assert_eq!(provider.calls(), 2, "retried: the body ran twice");
                assert_eq!(claims_in(&*db, COMMIT_TABLE, "effects-commit-plain", &id).await, 1);
            }

            /// Calls, then swallows a database error after which the database has ended
            /// the transaction by itself (issue 8's checked commit finds it).
            #[idempotent(consumer = "effects-swallow", key = id, effect = "send-first")]
            async fn send_then_swallow(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                swallow: &faults::Swallow,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                swallow.in_body(tx).await;
                Ok(call)
            }

            /// The same body without `effect`.
            #[idempotent(consumer = "effects-swallow-plain", key = id)]
            async fn plain_then_swallow(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                swallow: &faults::Swallow,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                swallow.in_body(tx).await;
                Ok(call)
            }

            #[tokio::test]
            async fn a_swallowed_error_is_rolled_back_after_one_run() {
                let pool = faults::pool().await;
                let swallow = faults::Swallow::new(&pool).await;
                let id = unique("send-first-swallow");
                let provider = Provider::default();
                let error = timeout(PATIENCE, send_then_swallow(&*pool, &id, &provider, &swallow))
                    .await
                    .expect("the call returns")
                    .unwrap_err();
                assert!(RolledBack::find(&error).is_some(), "{error:?}");
                assert_eq!(provider.calls(), 1, "RolledBack at once, without a second run");
                assert_eq!(claims(&*pool, "effects-swallow", &id).await, 0);

                // Without `effect` the call is run again first (issue 8), then RolledBack.
                let id = unique("plain-swallow");
                let provider = Provider::default();
                let error = timeout(PATIENCE, plain_then_swallow(&*pool, &id, &provider, &swallow))
                    .await
                    .expect("the call returns")
                    .unwrap_err();
                assert!(RolledBack::find(&error).is_some(), "{error:?}");
                assert_eq!(provider.calls(), MAX_ATTEMPTS);
                assert_eq!(claims(&*pool, "effects-swallow-plain", &id).await, 0);
            }
        }
    };
}

effects_suite!(
    postgres,
    conn = sqlx::PgConnection,
    faults = postgres_faults
);
effects_suite!(mysql, conn = sqlx::MySqlConnection, faults = mysql_faults);
effects_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    faults = sqlite_faults
);
