//! The `dedup` command on every backend, run in process (`dedup_cli::run`): what it prints
//! and exits with, and what it changed in the database.

use crate::backends::{Under, backends, exec, receive};

/// Runs `dedup` with `args`: exit status, stdout, stderr.
pub async fn dedup(args: &[&str]) -> (u8, String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let argv = std::iter::once("dedup").chain(args.iter().copied());
    let code = dedup_cli::run(argv, &mut out, &mut err).await;
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}

async fn count<DB: Under>(pool: &sqlx::Pool<DB>, sql: String) -> i64 {
    DB::count(pool, sql, vec![]).await
}

async fn queues_unknown_ids_and_prune<DB: Under>(pool: &sqlx::Pool<DB>, url: &str) {
    let inbox = dedup_suite::unique_table("cli_inbox");
    let ids_table = dedup_suite::unique_table("cli_ids");
    dedup_runtime::inbox::migrate_table(pool, &inbox)
        .await
        .unwrap();
    dedup_runtime::migrate_table(pool, &ids_table)
        .await
        .unwrap();
    let billing: Vec<String> = (0..3).map(|n| format!("bill-{n}")).collect();
    receive(pool, &inbox, "billing", &billing, br#"{"amount":5}"#).await;
    receive(pool, &inbox, "audit", &["audit-0".to_owned()], b"\x00\x01").await;
    exec(pool, DB::kill_sql(&inbox, 1), "timeout\x1b[2J", "billing").await;
    exec(pool, DB::kill_sql(&inbox, 10), "schema", "audit").await;
    let base = ["--database-url", url];
    let with = |rest: &[&'static str]| -> Vec<String> {
        base.iter()
            .map(|s| s.to_string())
            .chain(rest.iter().map(|s| s.to_string()))
            .collect()
    };
    let run = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        dedup(&args).await
    };
    let t = inbox.as_str();

    let (code, out, err) = run(with(&["inbox", "stats", "--table"])
        .into_iter()
        .chain([t.to_owned()])
        .collect())
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("billing") && out.contains("audit"), "{out}");
    assert!(out.contains("dead"), "{out}");

    let (code, out, err) = run([
        with(&["inbox", "dead", "--consumer", "billing", "--table"]),
        vec![t.to_owned()],
    ]
    .concat())
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("3 dead rows matching"), "{out}");
    assert!(
        out.contains("\"amount\": 5"),
        "the JSON payload pretty-printed: {out}"
    );
    assert!(
        out.contains("timeout\\u{1b}[2J"),
        "a control character escaped: {out}"
    );
    assert!(!out.contains('\u{1b}'), "{out}");

    let (code, _, err) =
        run([with(&["inbox", "requeue", "--table"]), vec![t.to_owned()]].concat()).await;
    assert_eq!(code, 2, "no rows named");
    assert!(err.contains("--all"), "{err}");

    let request = dedup_suite::unique("req");
    let requeue = [
        with(&["inbox", "requeue", "--all", "--table"]),
        vec![t.to_owned(), "--request-id".into(), request.clone()],
    ]
    .concat();
    let (code, out, err) = run(requeue.clone()).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("3 of 4 matching dead rows re-queued"), "{out}");
    assert!(
        out.contains("1 row left dead: older than the redelivery window (7d)"),
        "{out}"
    );
    assert_eq!(
        count(pool, format!("SELECT COUNT(*) FROM {t} WHERE state = 0")).await,
        3
    );

    // Dead again; the same request acts once: nothing changes.
    exec(pool, DB::kill_sql(&inbox, 1), "timeout", "billing").await;
    let (code, out, _) = run(requeue).await;
    assert_eq!(code, 0);
    assert!(out.contains("request already done"), "{out}");
    assert_eq!(
        count(pool, format!("SELECT COUNT(*) FROM {t} WHERE state = 3")).await,
        4
    );
    // The same request id for another action is refused.
    let (code, _, err) = run([
        with(&["inbox", "discard", "--all", "--table"]),
        vec![t.to_owned(), "--request-id".into(), request],
    ]
    .concat())
    .await;
    assert_eq!(code, 2);
    assert!(err.contains("used for another action"), "{err}");
    assert_eq!(
        count(pool, format!("SELECT COUNT(*) FROM {t} WHERE state = 3")).await,
        4
    );

    let (code, out, err) = run([
        with(&["inbox", "discard", "--consumer", "audit", "--table"]),
        vec![t.to_owned()],
    ]
    .concat())
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 of 1 matching dead rows discarded"), "{out}");
    assert_eq!(
        count(pool, format!("SELECT COUNT(*) FROM {t} WHERE state = 2")).await,
        1
    );

    // Unknown outcomes: listed, resolved, gone.
    exec(pool, DB::unknown_sql(&ids_table), "payments", "evt_7").await;
    let d = ids_table.as_str();
    let (code, out, err) =
        run([with(&["unknown", "list", "--table"]), vec![d.to_owned()]].concat()).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("payments") && out.contains("evt_7") && out.contains("outcome unknown"),
        "{out}"
    );
    let (code, out, err) = run([
        with(&[
            "unknown",
            "resolve",
            "--consumer",
            "payments",
            "--as",
            "retry",
            "--table",
        ]),
        vec![d.to_owned(), "evt_7".into()],
    ]
    .concat())
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("resolved: deleted"), "{out}");
    let (_, out, _) =
        run([with(&["unknown", "list", "--table"]), vec![d.to_owned()]].concat()).await;
    assert!(out.contains("no unresolved ids"), "{out}");
    assert_eq!(count(pool, format!("SELECT COUNT(*) FROM {d}")).await, 0);

    // Ids and prune on the same table.
    exec(pool, DB::unknown_sql(&ids_table), "payments", "evt_8").await;
    let (code, out, _) = run([
        with(&["ids", "lookup", "--consumer", "payments", "--table"]),
        vec![d.to_owned(), "evt_9".into()],
    ]
    .concat())
    .await;
    assert_eq!(code, 0);
    assert!(out.contains("evt_9  no record"), "{out}");
    let (code, out, err) = run([
        with(&["ids", "forget", "--consumer", "payments", "--table"]),
        vec![d.to_owned(), "evt_8".into(), "evt_9".into()],
    ]
    .concat())
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("evt_8  forgotten") && out.contains("evt_9  no record; nothing forgotten"),
        "{out}"
    );
    assert!(out.contains("1 of 2 ids forgotten"), "{out}");
    assert_eq!(count(pool, format!("SELECT COUNT(*) FROM {d}")).await, 0);
    exec(pool, DB::unknown_sql(&ids_table), "payments", "evt_8").await;
    let (code, out, err) = run([
        with(&[
            "prune",
            "--older-than",
            "2d",
            "--redelivery-window",
            "1d",
            "--dry-run",
            "--table",
        ]),
        vec![d.to_owned()],
    ]
    .concat())
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("dry run: 0 ids would be deleted"), "{out}");
    assert!(
        out.contains("1 id not processed"),
        "the unresolved row is kept: {out}"
    );
    let (code, _, err) = run([
        with(&[
            "prune",
            "--older-than",
            "1d",
            "--redelivery-window",
            "2d",
            "--table",
        ]),
        vec![d.to_owned()],
    ]
    .concat())
    .await;
    assert_eq!(code, 2);
    assert!(err.contains("refused"), "{err}");
}

macro_rules! cli_suite {
    ($backend:ident, $db:ty, $pool:expr, |$url_db:ident| $url:expr) => {
        mod $backend {
            #[tokio::test]
            async fn queues_unknown_ids_and_prune() {
                let $url_db = $pool;
                let url = $url;
                super::queues_unknown_ids_and_prune::<$db>(&$url_db, &url).await;
            }
        }
    };
}

backends!(cli_suite);

#[tokio::test]
async fn bad_urls_and_arguments_exit_2() {
    let (code, _, err) = dedup(&["--database-url", "redis://x", "inbox", "stats"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("expected a postgres://"), "{err}");
    let (code, _, err) = dedup(&[
        "--database-url",
        "sqlite:/nonexistent/x.db",
        "inbox",
        "stats",
    ])
    .await;
    assert_eq!(code, 1, "{err}");
    let (code, _, err) = dedup(&["inbox", "shuffle"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("invalid value 'shuffle'"), "{err}");
    let (code, out, _) = dedup(&["--help"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("console"), "{out}");
}
