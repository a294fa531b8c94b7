//! Checks and the report: what the database holds for a run, the checks every harness
//! makes, the figures it prints, and the cleanup after it.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::PgPool;

use crate::harness::*;

/// What the database holds for a run.
pub(crate) struct Stored {
    /// Effect rows per message id.
    pub(crate) effects: HashMap<String, i64>,
    pub(crate) dedup_rows: i64,
}

pub(crate) async fn stored(
    pool: &PgPool,
    effects_table: &str,
    consumer: &str,
    run: &str,
) -> Stored {
    stored_in(pool, effects_table, "processed_messages", consumer, run).await
}

/// [`stored`], the dedup rows read from `dedup_table` (the inbox's, for the inbox
/// consumer: its rows processed).
pub(crate) async fn stored_in(
    pool: &PgPool,
    effects_table: &str,
    dedup_table: &str,
    consumer: &str,
    run: &str,
) -> Stored {
    let pattern = format!("{run}/%");
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT message_id, COUNT(*) FROM {effects_table} WHERE message_id LIKE $1 \
         GROUP BY message_id"
    )))
    .bind(&pattern)
    .fetch_all(pool)
    .await
    .expect("read the effects");
    let processed = if dedup_table == "processed_messages" {
        ""
    } else {
        " AND state = 2"
    };
    let dedup_rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {dedup_table} WHERE consumer = $1 AND message_id LIKE $2{processed}"
    )))
    .bind(consumer)
    .bind(&pattern)
    .fetch_one(pool)
    .await
    .expect("count the dedup rows");
    Stored {
        effects: rows.into_iter().collect(),
        dedup_rows,
    }
}

/// Every published id has exactly one effect, there are no others, and one dedup row
/// each; the kills did land, including between COMMIT and acknowledgement.
pub(crate) fn check(published: &[Publish], stored: &Stored, tally: &Tally, scale: &Scale) {
    let unique: HashSet<&str> = published.iter().filter_map(|p| p.id.as_deref()).collect();
    let wrong: Vec<(&str, i64)> = unique
        .iter()
        .map(|id| (*id, stored.effects.get(*id).copied().unwrap_or(0)))
        .filter(|(_, rows)| *rows != 1)
        .take(10)
        .collect();
    assert!(
        wrong.is_empty(),
        "messages whose effect is not applied exactly once (id, rows), first 10: {wrong:?}"
    );
    let strangers: Vec<&String> = stored
        .effects
        .keys()
        .filter(|id| !unique.contains(id.as_str()))
        .take(10)
        .collect();
    assert!(
        strangers.is_empty(),
        "effects of unknown ids: {strangers:?}"
    );
    assert_eq!(
        stored.effects.len(),
        unique.len(),
        "ids with an effect vs unique ids published"
    );
    assert_eq!(
        stored.dedup_rows,
        unique.len() as i64,
        "dedup rows vs unique ids published"
    );
    assert_eq!(tally.kills, scale.kills, "kills made");
    if scale.kills >= 20 {
        assert!(
            tally.kills_in_window >= scale.kills / 5,
            "only {} of {} kills caught a message between COMMIT and acknowledgement",
            tally.kills_in_window,
            tally.kills
        );
        assert!(
            tally
                .caught_in_window
                .iter()
                .any(|id| tally.duplicate_ids.contains(id)),
            "no message caught between COMMIT and acknowledgement came back as a duplicate"
        );
    }
}

/// The figures of a run, written straight to the terminal: libtest captures `println!`,
/// and these figures are what the test is for.
#[allow(clippy::too_many_arguments)]
pub(crate) fn report(
    broker: &str,
    published: &[Publish],
    stored: &Stored,
    tally: &Tally,
    scale: &Scale,
    dead_lettered: usize,
    broker_state: &str,
    elapsed: Duration,
) {
    let unique = published.iter().filter(|p| p.id.is_some()).count();
    let unique_ids: HashSet<&str> = published.iter().filter_map(|p| p.id.as_deref()).collect();
    let duplicates_published = unique - unique_ids.len();
    let caught_then_duplicate = tally
        .caught_in_window
        .iter()
        .filter(|id| tally.duplicate_ids.contains(*id))
        .count();
    let effects: i64 = stored.effects.values().sum();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "\n== {broker}: crash harness (seed {}) ==",
        scale.seed
    );
    let _ = writeln!(
        text,
        "published:      {} broker messages = {} unique ids + {} published duplicates + {} \
         poison (no id)",
        published.len(),
        unique_ids.len(),
        duplicates_published,
        POISON
    );
    let _ = writeln!(
        text,
        "kills:          {} SIGKILLs over {} consumer lives ({} at start-up, {} on a commit, \
         {} anywhere; {} after waiting for a trigger that did not come)",
        tally.kills,
        tally.lives,
        tally.kills_by_kind[0],
        tally.kills_by_kind[1],
        tally.kills_by_kind[2],
        tally.kills_on_timeout
    );
    let _ = writeln!(
        text,
        "commit→ack:     {} kills landed with a message committed but not acknowledged ({} \
         messages; {} of them redelivered and recognised as duplicates)",
        tally.kills_in_window,
        tally.caught_in_window.len(),
        caught_then_duplicate
    );
    let _ = writeln!(
        text,
        "                and {} commits whose process was killed before it could even report \
         them",
        usize::try_from(effects)
            .unwrap_or(0)
            .saturating_sub(tally.committed_ids.len())
    );
    let _ = writeln!(
        text,
        "deliveries:     {} ({} redeliveries flagged by the broker); {} committed, {} \
         duplicates recognised, {} acknowledged, {} retried, {} dead-lettered",
        tally.deliveries,
        tally.redeliveries,
        tally.committed,
        tally.duplicates,
        tally.acked,
        tally.retries,
        tally.dead
    );
    let _ = writeln!(
        text,
        "effects:        {effects} rows for {} ids, each exactly once; {} dedup rows",
        stored.effects.len(),
        stored.dedup_rows
    );
    let _ = writeln!(
        text,
        "broker:         {broker_state}; dead letters: {dead_lettered} (the {POISON} poison \
         messages)"
    );
    let _ = writeln!(text, "duration:       {:.1} s", elapsed.as_secs_f64());
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// An example consumer under the harness: its example's name, its effects table and its
/// dedup consumer name.
pub(crate) struct Subject {
    pub(crate) example: &'static str,
    pub(crate) effects_table: &'static str,
    pub(crate) consumer: &'static str,
}

/// The part of a consumer's crash harness after its broker holds `published`: builds the
/// example, kills it `scale.kills` times and runs it to the end with `env`
/// ([`crash_loop`], the last life exiting once idle for `idle`), then reads the run's
/// effect and dedup rows back and [`check`]s them.
pub(crate) async fn crash_and_check(
    pool: &PgPool,
    subject: &Subject,
    env: Vec<(&'static str, String)>,
    scale: &Scale,
    idle: Duration,
    run: &str,
    published: &[Publish],
) -> (Tally, Stored) {
    let name = subject.example;
    let program = tokio::task::spawn_blocking(move || example(name))
        .await
        .expect("build the examples");
    let tally = {
        let scale = scale.clone();
        tokio::task::spawn_blocking(move || crash_loop(&program, &env, &scale, idle))
            .await
            .expect("the crash loop")
    };
    let stored = stored(pool, subject.effects_table, subject.consumer, run).await;
    check(published, &stored, &tally, scale);
    (tally, stored)
}

/// Runs `body`, then `cleanup` whatever happened, then re-raises a panic of `body`.
pub(crate) async fn with_cleanup<T>(
    body: impl Future<Output = T>,
    cleanup: impl Future<Output = ()>,
) -> T {
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    cleanup.await;
    outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Deletes a passed run's effect and dedup rows, so that the tables do not grow with
/// every run. (A failed run keeps them, for a look.)
pub(crate) async fn forget_run(pool: &PgPool, effects_table: &str, consumer: &str, run: &str) {
    forget_run_in(pool, effects_table, "processed_messages", consumer, run).await;
}

/// [`forget_run`], the dedup rows in `dedup_table`.
pub(crate) async fn forget_run_in(
    pool: &PgPool,
    effects_table: &str,
    dedup_table: &str,
    consumer: &str,
    run: &str,
) {
    let pattern = format!("{run}/%");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {effects_table} WHERE message_id LIKE $1"
    )))
    .bind(&pattern)
    .execute(pool)
    .await
    .expect("delete this run's effects");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {dedup_table} WHERE consumer = $1 AND message_id LIKE $2"
    )))
    .bind(consumer)
    .bind(&pattern)
    .execute(pool)
    .await
    .expect("delete this run's dedup rows");
}
