//! Operating the outbox: on every backend, stats by state, health and pruning, and the
//! operator's calls on dead rows; the operator's command (`dedup outbox`) on a SQLite
//! outbox.

use std::time::Duration;

use dedup_runtime::outbox::{Cause, Health, Outbox};

use super::*;

macro_rules! operator_suite {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        pool = $pool:expr,
        row = $row:literal,
        count = $count:literal,
        effects = $effects:literal,
        effect = $effect:literal,
        effect_count = $effect_count:literal,
        begin_writing = $begin_writing:literal,
        state = $state:literal,
        expire = $expire:literal,
        $(late_commits = $late:literal,)?
    ) => {
        mod $backend {
            use super::*;
            use crate::outbox::common::$backend::*;

            /// Stats by state, the oldest unsent row's age, the relay's last sign of life
            /// and the health it gives; pruning deletes sent rows only.
            #[tokio::test]
            async fn stats_health_and_pruning() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let minute = Duration::from_secs(60);
                assert_eq!(
                    outbox.health(pool, minute).await.unwrap(),
                    Health::RelayStale { last_seen: None },
                    "no relay ever ran"
                );
                let cause = Cause::new("outbox-stats", "evt_1").unwrap();
                enqueue_all(pool, &outbox, &cause, &[b"a", b"poison", b"c"]).await;
                let before = outbox.stats(pool).await.unwrap();
                assert_eq!(
                    (before.unsent, before.claimed, before.sent, before.dead),
                    (3, 0, 0, 0)
                );
                assert!(before.oldest_unsent.unwrap() < minute);
                assert_eq!(before.relay_last_seen, None);

                let relayed = outbox
                    .relay(pool)
                    .max_attempts(1)
                    .relay_batch(&Recorder::default())
                    .await
                    .unwrap();
                assert_eq!((relayed.sent, relayed.dead), (2, 1));
                let after = outbox.stats(pool).await.unwrap();
                assert_eq!(
                    (after.unsent, after.claimed, after.sent, after.dead),
                    (0, 0, 2, 1)
                );
                assert_eq!(after.oldest_unsent, None);
                assert!(after.relay_last_seen.unwrap() < minute);
                assert_eq!(outbox.health(pool, minute).await.unwrap(), Health::Healthy);

                let hour = Duration::from_secs(3600);
                let prune = |age, window| dedup_runtime::Prune::new(age, window);
                let early = prune(minute, hour).run_outbox(&outbox, pool, |_| {}).await;
                assert!(
                    matches!(early, Err(dedup_runtime::PruneError::WindowTooShort { .. })),
                    "{early:?}"
                );
                let young = prune(hour, hour)
                    .run_outbox(&outbox, pool, |_| {})
                    .await
                    .unwrap();
                assert_eq!((young.deleted, young.done), (0, true));
                assert_eq!(
                    outbox.stats(pool).await.unwrap().sent,
                    2,
                    "nothing deleted yet"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
                let mut seen = Vec::new();
                let done = prune(Duration::ZERO, Duration::ZERO)
                    .batch_size(1)
                    .run_outbox(&outbox, pool, |progress| seen.push(progress.deleted))
                    .await
                    .unwrap();
                assert_eq!(done.deleted, 2, "the sent rows");
                assert_eq!(
                    seen,
                    [1, 2, 2],
                    "one row per batch, then the batch that found none"
                );
                let pruned = outbox.stats(pool).await.unwrap();
                assert_eq!((pruned.sent, pruned.dead), (0, 1), "the dead row kept");
            }

            /// The operator's calls: a dead row listed with its error, re-queued and then
            /// sent once; another discarded, recorded as sent and never sent.
            #[tokio::test]
            async fn dead_rows_are_listed_requeued_and_discarded() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let cause = Cause::new("outbox-dead", "evt_1").unwrap();
                let ids = enqueue_all(pool, &outbox, &cause, &[b"poison", b"poison"]).await;
                let relay = outbox.relay(pool).max_attempts(1);
                let relayed = relay.relay_batch(&Recorder::default()).await.unwrap();
                assert_eq!(relayed.dead, 2);
                let dead = outbox.dead(pool, 10).await.unwrap();
                assert_eq!(dead.iter().map(|row| row.id).collect::<Vec<_>>(), ids);
                assert_eq!(
                    (dead[0].destination.as_str(), dead[0].attempts),
                    ("events", 1)
                );
                assert!(
                    dead[0]
                        .last_error
                        .as_deref()
                        .unwrap()
                        .contains("the broker refused")
                );

                // The first re-queued, and its broker takes it this time.
                assert!(outbox.requeue(pool, ids[0]).await.unwrap());
                assert!(
                    !outbox.requeue(pool, ids[0]).await.unwrap(),
                    "no longer dead"
                );
                let quick = Quick(Mutex::new(Vec::new()));
                assert_eq!(relay.relay_batch(&quick).await.unwrap().sent, 1);
                assert_eq!(quick.0.lock().unwrap().clone(), [ids[0]]);
                assert_eq!(state(pool, &outbox, ids[0]).await.0, 2);

                // The second discarded: recorded as sent, never sent.
                assert!(outbox.discard(pool, ids[1]).await.unwrap());
                assert_eq!(relay.relay_batch(&quick).await.unwrap().claimed, 0);
                assert_eq!(quick.0.lock().unwrap().len(), 1);
                let (row_state, _, last_error) = state(pool, &outbox, ids[1]).await;
                assert_eq!(row_state, 2);
                assert!(last_error.is_some(), "its error kept");
                assert!(outbox.dead(pool, 10).await.unwrap().is_empty());
            }
        }
    };
}

outbox_backends!(operator_suite);

/// The operator's command (`dedup outbox`, run in process) on a SQLite outbox with two dead
/// rows: stats with the relay's last sign of life, the dead rows with their error, one
/// re-queued and one discarded by id, then the sent rows pruned.
#[tokio::test]
async fn the_operator_command_lists_requeues_discards_and_prunes() {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("outbox-ops", "evt_1").unwrap();
    let mut tx = db.begin().await.unwrap();
    let mut ids = Vec::new();
    for index in 0..2 {
        let message = cause.nth_outgoing(index, "events", b"poison");
        outbox.enqueue(&mut *tx, &message).await.unwrap();
        ids.push(message.id().to_string());
    }
    tx.commit().await.unwrap();
    let relayed = outbox
        .relay(&*db)
        .max_attempts(1)
        .relay_batch(&Recorder::default())
        .await
        .unwrap();
    assert_eq!(relayed.dead, 2);

    let url = format!("sqlite:{}", db.path().display());
    let dedup = |args: &[&str]| {
        let mut all: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
        all.extend(["--database-url".to_owned(), url.clone()]);
        async move {
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            crate::inbox::operator::dedup(&all).await
        }
    };
    let (code, out, err) = dedup(&["outbox", "stats"]).await;
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .find(|line| line.trim_start().starts_with("outbox-ops"))
        .unwrap();
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&cells[..5], ["outbox-ops", "0", "0", "0", "2"], "{out}");
    assert!(out.contains("a relay last ran"), "{out}");
    let (code, out, _) = dedup(&["outbox", "dead"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains(&format!("{}  consumer outbox-ops  to events", ids[0]))
            && out.contains("after 1 attempt: the broker refused"),
        "{out}"
    );
    let (code, out, _) = dedup(&["outbox", "requeue", "--id", &ids[0]]).await;
    assert_eq!(code, 0);
    assert!(out.contains("1 of 1 matching dead rows re-queued"), "{out}");
    let (code, out, _) = dedup(&["outbox", "discard", "--id", &ids[1]]).await;
    assert_eq!(code, 0);
    assert!(out.contains("1 of 1 matching dead rows discarded"), "{out}");
    let (code, _, err) = dedup(&["outbox", "requeue", "--id", "not-a-uuid"]).await;
    assert_eq!(code, 2, "a bad id is a usage error");
    assert!(err.contains("not an outgoing id"), "{err}");
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (code, out, err) = dedup(&[
        "outbox",
        "prune",
        "--older-than",
        "0s",
        "--redelivery-window",
        "0s",
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("1 row sent more than 0ms ago deleted"),
        "the discarded row: {out}"
    );
    let stats = outbox.stats(&*db).await.unwrap();
    assert_eq!(
        (stats.unsent, stats.sent, stats.dead),
        (1, 0, 0),
        "the re-queued row waits for the relay"
    );
}
