//! The console over a real HTTP server and client, on every backend: the JSON API's every
//! action, bulk by filter over 10,000 rows, an action retried with its request id, a
//! refused requeue past the window, unknown outcomes; and on SQLite the pages' guards:
//! read-only, the token, the form token, cross-site POSTs, escaping.

use std::sync::Arc;
use std::time::Duration;

use dedup_cli::ConsoleArgs;
use dedup_cli::console::{Console, router};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::backends::{Under, backends, exec, receive};

pub fn args(inbox: &str, outbox: &str, ids: &str) -> ConsoleArgs {
    ConsoleArgs {
        listen: "127.0.0.1:0".to_owned(),
        read_only: false,
        inbox_tables: vec![inbox.to_owned()],
        outbox_tables: vec![outbox.to_owned()],
        table: ids.to_owned(),
        redelivery_window: Duration::from_secs(7 * 86_400),
        windows: Vec::new(),
        token: None,
    }
}

/// Serves `console` on loopback: its base URL.
pub async fn serve(console: Arc<Console>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router(console)).await });
    format!("http://{address}")
}

async fn count<DB: Under>(pool: &sqlx::Pool<DB>, sql: String) -> i64 {
    DB::count(pool, sql, vec![]).await
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> (StatusCode, String, Value) {
    let response = http.post(url).json(&body).send().await.unwrap();
    let status = response.status();
    let kind = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, kind, response.json().await.unwrap())
}

async fn api_actions<DB: Under>(pool: &sqlx::Pool<DB>, pools: dedup_cli::Pools)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Connection: dedup_runtime::outbox::OutboxConnection,
{
    let inbox = dedup_suite::unique_table("api_inbox");
    let outbox = dedup_suite::unique_table("api_outbox");
    let ids = dedup_suite::unique_table("api_ids");
    dedup_runtime::inbox::migrate_table(pool, &inbox)
        .await
        .unwrap();
    dedup_runtime::outbox::migrate_table(pool, &outbox)
        .await
        .unwrap();
    dedup_runtime::migrate_table(pool, &ids).await.unwrap();
    let bulk: Vec<String> = (0..10_000).map(|n| format!("bulk-{n}")).collect();
    receive(pool, &inbox, "bulk", &bulk, br#"{"n":1}"#).await;
    receive(
        pool,
        &inbox,
        "old",
        &["old-1".to_owned(), "old-2".to_owned()],
        b"x",
    )
    .await;
    exec(
        pool,
        DB::kill_sql(&inbox, 1),
        "timeout from <b>bank</b>",
        "bulk",
    )
    .await;
    exec(pool, DB::kill_sql(&inbox, 10), "timeout, old", "old").await;
    let base = serve(Console::new(pools, args(&inbox, &outbox, &ids))).await;
    let http = reqwest::Client::new();
    let dead_of = |state: i64| {
        count(
            pool,
            format!("SELECT COUNT(*) FROM {inbox} WHERE state = {state}"),
        )
    };

    // The overview.
    let overview: Value = http
        .get(format!("{base}/api/overview"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let queue = &overview["queues"][0];
    assert_eq!(queue["table"], inbox.as_str());
    assert_eq!(queue["consumers"][0]["consumer"], "bulk");
    assert_eq!(queue["consumers"][0]["dead"], 10_000);
    assert_eq!(
        overview["queues"][1]["consumers"],
        json!([]),
        "an empty outbox"
    );

    // A page of dead rows, with the next page's cursor.
    let page: Value = http
        .get(format!(
            "{base}/api/inbox/{inbox}/dead?consumer=bulk&limit=2"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["total"], 10_000);
    assert_eq!(page["rows"].as_array().unwrap().len(), 2);
    assert_eq!(page["rows"][0]["payload_kind"], "json");
    assert_eq!(page["rows"][0]["payload_preview"], "{\n  \"n\": 1\n}");
    assert_eq!(page["rows"][0]["last_error"], "timeout from <b>bank</b>");
    assert_eq!(page["next_after"], page["rows"][1]["row"]);

    // Everything the filter matches, not one page: 10,000 rows in one action.
    let requeue = format!("{base}/api/inbox/{inbox}/requeue");
    let request = dedup_suite::unique("r-bulk");
    let body =
        json!({"request_id": request, "filter": {"consumer": "bulk", "error_contains": "<b>bank"}});
    let (status, _, answer) = post(&http, requeue.clone(), body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(
        (answer["done"].as_u64(), answer["replayed"].as_bool()),
        (Some(10_000), Some(false))
    );
    assert_eq!(dead_of(0).await, 10_000);
    // The same request again, after the rows died again: it acts once.
    exec(
        pool,
        DB::kill_sql(&inbox, 1),
        "timeout from <b>bank</b>",
        "bulk",
    )
    .await;
    let (status, _, answer) = post(&http, requeue.clone(), body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (answer["done"].as_u64(), answer["replayed"].as_bool()),
        (Some(10_000), Some(true))
    );
    assert_eq!(dead_of(3).await, 10_002, "the retry changed nothing");
    // The request id for another action: refused, nothing changed.
    let (status, kind, answer) = post(
        &http,
        requeue.clone(),
        json!({"request_id": request, "filter": {"consumer": "old"}}),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
    assert_eq!(kind, "application/problem+json");

    // A request id that no dedup table can hold: refused before anything runs.
    for bad in [String::new(), "r".repeat(256)] {
        let (status, _, answer) = post(
            &http,
            requeue.clone(),
            json!({"request_id": bad, "filter": {"consumer": "old"}}),
        )
        .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
        assert!(
            answer["detail"]
                .as_str()
                .unwrap()
                .starts_with("the request id"),
            "{answer}"
        );
    }
    let mut longest = dedup_suite::unique("r");
    longest.push_str(&"r".repeat(255 - longest.len()));
    let (status, _, answer) = post(
        &http,
        requeue.clone(),
        json!({"request_id": longest, "filter": {"consumer": "nobody"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "255 bytes, the limit: {answer}");

    // Past the window: refused, saying so; the rows stay dead.
    let (status, _, answer) = post(
        &http,
        requeue.clone(),
        json!({"filter": {"consumer": "old"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (answer["done"].as_u64(), answer["refused"].as_u64()),
        (Some(0), Some(2))
    );
    assert_eq!(dead_of(3).await, 10_002);

    // No rows named; an unknown table: problems.
    let (status, kind, answer) = post(&http, requeue.clone(), json!({})).await;
    assert_eq!(
        (status, kind.as_str()),
        (StatusCode::BAD_REQUEST, "application/problem+json")
    );
    assert!(
        answer["type"]
            .as_str()
            .unwrap()
            .ends_with("#console-no-rows"),
        "{answer}"
    );
    let (status, _, _) = post(
        &http,
        format!("{base}/api/inbox/processed_messages/requeue"),
        json!({"all": true}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let response = http.post(&requeue).body("{}").send().await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "JSON only"
    );

    // Discard everything, by `Idempotency-Key`.
    let discard = dedup_suite::unique("d-all");
    let response = http
        .post(format!("{base}/api/inbox/{inbox}/discard"))
        .header("idempotency-key", format!("\"{discard}\""))
        .json(&json!({"all": true}))
        .send()
        .await
        .unwrap();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["done"], 10_002);
    assert_eq!(answer["request_id"], discard.as_str());
    assert_eq!(dead_of(2).await, 10_002);

    // A selection by row number, and the outbox by id.
    receive(
        pool,
        &inbox,
        "picked",
        &["p-1".to_owned(), "p-2".to_owned()],
        b"x",
    )
    .await;
    exec(pool, DB::kill_sql(&inbox, 1), "boom", "picked").await;
    let page: Value = http
        .get(format!("{base}/api/inbox/{inbox}/dead?consumer=picked"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let first = page["rows"][0]["row"].clone();
    let (status, _, answer) =
        post(&http, requeue.clone(), json!({"filter": {"rows": [first]}})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(
        (answer["matched"].as_u64(), answer["done"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(dead_of(3).await, 1, "the other picked row stays dead");
    let outgoing = {
        let outbox = dedup_runtime::outbox::Outbox::new()
            .in_table(&outbox)
            .unwrap();
        let cause = dedup_runtime::outbox::Cause::new("shipping", "order-1").unwrap();
        let message = cause.nth_outgoing(0, "shipments", b"{}");
        let mut tx = pool.begin().await.unwrap();
        outbox.enqueue(&mut *tx, &message).await.unwrap();
        tx.commit().await.unwrap();
        message.id().to_string()
    };
    exec(pool, DB::kill_sql(&outbox, 1), "refused", "shipping").await;
    let requeue_out = format!("{base}/api/outbox/{outbox}/requeue");
    let (status, _, answer) = post(
        &http,
        requeue_out.clone(),
        json!({"filter": {"ids": ["not-a-uuid"]}}),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
    let (status, _, answer) =
        post(&http, requeue_out, json!({"filter": {"ids": [outgoing]}})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["done"], 1);
    assert_eq!(
        count(
            pool,
            format!("SELECT COUNT(*) FROM {outbox} WHERE state = 0")
        )
        .await,
        1
    );

    // Unknown outcomes.
    exec(pool, DB::unknown_sql(&ids), "payments", "evt_7").await;
    let unknown: Value = http
        .get(format!("{base}/api/unknown"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        unknown["rows"],
        json!([{"consumer": "payments", "message_id": "evt_7", "status": "outcome unknown"}])
    );
    let request = dedup_suite::unique("resolve");
    let resolve =
        json!({"request_id": request, "consumer": "payments", "ids": ["evt_7"], "as": "done"});
    let url = format!("{base}/api/unknown/resolve");
    let (status, _, answer) = post(&http, url.clone(), resolve.clone()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["replayed"], false);
    assert_eq!(answer["ids"], json!([{"id": "evt_7", "resolved": true}]));
    // The row is unknown again (another delivery marked it and died): the retried request
    // acts once, answering what it did.
    let [first, second] = DB::PLACEHOLDERS;
    let forget = format!("DELETE FROM {ids} WHERE message_id = {first} AND consumer = {second}");
    exec(pool, forget, "evt_7", "payments").await;
    exec(pool, DB::unknown_sql(&ids), "payments", "evt_7").await;
    let (_, _, answer) = post(&http, url.clone(), resolve).await;
    assert_eq!(answer["replayed"], true, "{answer}");
    assert_eq!(answer["ids"], json!([{"id": "evt_7", "resolved": true}]));
    assert_eq!(
        count(
            pool,
            format!("SELECT COUNT(*) FROM {ids} WHERE state IS NOT NULL")
        )
        .await,
        1,
        "still unknown: the retry did not resolve it"
    );
    let fresh = json!({"consumer": "payments", "ids": ["evt_7"], "as": "done"});
    let (_, _, answer) = post(&http, url, fresh).await;
    assert_eq!(
        (
            answer["replayed"].as_bool(),
            answer["ids"][0]["resolved"].as_bool()
        ),
        (Some(false), Some(true))
    );
    assert_eq!(
        count(
            pool,
            format!("SELECT COUNT(*) FROM {ids} WHERE state IS NULL")
        )
        .await,
        1
    );
}

macro_rules! api_suite {
    ($backend:ident, $db:ty, $pool:expr, |$url_db:ident| $url:expr) => {
        mod $backend {
            #[tokio::test]
            async fn api_actions() {
                let $url_db = $pool;
                let url = $url;
                let pools = dedup_cli::Pools::connect(&url, 4).await.unwrap();
                super::api_actions::<$db>(&$url_db, pools).await;
            }
        }
    };
}

backends!(api_suite);

/// A SQLite database with one inbox table holding one dead row whose payload and error
/// text are markup.
async fn hostile() -> (dedup_suite::TempSqlite, String, String) {
    let db = dedup_suite::sqlite().await;
    let inbox = dedup_suite::unique_table("pages_inbox");
    dedup_runtime::inbox::migrate_table(&*db, &inbox)
        .await
        .unwrap();
    receive(
        &*db,
        &inbox,
        "web",
        &["<img src=x onerror=alert(1)>".to_owned()],
        b"<script>alert('payload')</script>",
    )
    .await;
    exec(
        &*db,
        <sqlx::Sqlite as Under>::kill_sql(&inbox, 1),
        "<script>alert('error')</script>",
        "web",
    )
    .await;
    let url = format!("sqlite:{}", db.path().display());
    (db, inbox, url)
}

#[tokio::test]
async fn pages_escape_guard_and_act_through_forms() {
    let (db, inbox, url) = hostile().await;
    let pools = dedup_cli::Pools::connect(&url, 2).await.unwrap();
    let base = serve(Console::new(
        pools,
        args(&inbox, "outbox_messages", "processed_messages"),
    ))
    .await;
    let http = reqwest::Client::new();
    let page = http
        .get(format!("{base}/inbox/{inbox}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("&lt;script&gt;alert(&#39;payload&#39;)&lt;/script&gt;"),
        "{page}"
    );
    assert!(
        page.contains("&lt;script&gt;alert(&#39;error&#39;)&lt;/script&gt;"),
        "{page}"
    );
    assert!(
        page.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "{page}"
    );
    assert!(
        !page.contains("<script>") && !page.contains("<img"),
        "nothing stored is markup: {page}"
    );
    let token = between(&page, "name=\"csrf\" value=\"", "\"");
    let row = between(&page, "name=\"row\" value=\"", "\"");
    let dead = || async { dedup_suite::rows(&*db, &inbox, "state", "3").await };

    // Without the form token: refused, nothing changed.
    let request = dedup_suite::unique("f");
    let form = [
        ("kind", "discard"),
        ("scope", "selected"),
        ("row", row.as_str()),
        ("request_id", request.as_str()),
    ];
    let response = http
        .post(format!("{base}/inbox/{inbox}/act"))
        .form(&form)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert_eq!(dead().await, 1);
    // With it but cross-site: refused.
    let mut with_token = form.to_vec();
    with_token.push(("csrf", token.as_str()));
    let response = http
        .post(format!("{base}/inbox/{inbox}/act"))
        .header("sec-fetch-site", "cross-site")
        .form(&with_token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert_eq!(dead().await, 1);
    // From the page: acts; a double submit acts once.
    for replayed in [false, true] {
        let response = http
            .post(format!("{base}/inbox/{inbox}/act"))
            .form(&with_token)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let text = response.text().await.unwrap();
        assert!(
            text.contains("1 of 1 matching dead rows discarded"),
            "{text}"
        );
        assert_eq!(
            text.contains("already been carried out"),
            replayed,
            "{text}"
        );
    }
    assert_eq!(dead().await, 0);
}

#[tokio::test]
async fn read_only_changes_nothing_and_shows_no_buttons() {
    let (db, inbox, url) = hostile().await;
    let pools = dedup_cli::Pools::connect(&url, 2).await.unwrap();
    let mut args = args(&inbox, "outbox_messages", "processed_messages");
    args.read_only = true;
    let base = serve(Console::new(pools, args)).await;
    let http = reqwest::Client::new();
    let page = http
        .get(format!("{base}/inbox/{inbox}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("Read-only"), "{page}");
    assert!(
        !page.contains("<button type=\"submit\" name=\"kind\""),
        "{page}"
    );
    let (status, kind, _) = post(
        &http,
        format!("{base}/api/inbox/{inbox}/discard"),
        json!({"all": true}),
    )
    .await;
    assert_eq!(
        (status, kind.as_str()),
        (StatusCode::FORBIDDEN, "application/problem+json")
    );
    assert_eq!(dedup_suite::rows(&*db, &inbox, "state", "3").await, 1);
    let tables = dedup_suite::rows(&*db, "sqlite_master", "name", "dedup_operator_actions").await;
    assert_eq!(tables, 0, "read-only creates no table");
}

#[tokio::test]
async fn a_token_guards_the_api_and_the_pages() {
    let (_db, inbox, url) = hostile().await;
    let pools = dedup_cli::Pools::connect(&url, 2).await.unwrap();
    let mut args = args(&inbox, "outbox_messages", "processed_messages");
    args.token = Some("s3cret".to_owned());
    let base = serve(Console::new(pools, args)).await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let response = http
        .get(format!("{base}/api/overview"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let response = http
        .get(format!("{base}/api/overview"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let response = http
        .get(format!("{base}/api/overview"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let response = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(response.headers()["location"], "/login");
    let response = http
        .post(format!("{base}/login"))
        .form(&[("token", "nope")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let response = http
        .post(format!("{base}/login"))
        .form(&[("token", "s3cret")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let cookie = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert!(
        !cookie.contains("s3cret"),
        "the cookie is not the token: {cookie}"
    );
    let session = cookie.split(';').next().unwrap();
    let response = http
        .get(format!("{base}/"))
        .header("cookie", session)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

fn between(text: &str, start: &str, end: &str) -> String {
    let from = text
        .find(start)
        .unwrap_or_else(|| panic!("{start} in {text}"))
        + start.len();
    let to = text[from..].find(end).unwrap() + from;
    text[from..to].to_owned()
}
