//! The console's pages in a real browser: headless Chromium driven through ChromeDriver
//! (Debian's `chromium` and `chromium-driver`, which `.ci/run` installs) over the W3C
//! WebDriver protocol, spoken with the suite's HTTP client. An inbox worker kills a poison
//! message; the operator finds the dead row from the overview, sees its payload and error
//! text — both `<script>` — shown as text, selects it and requeues it; the fixed worker
//! processes it; the overview shows it processed. Screenshots of each page are kept in
//! `target/console-screenshots/` for review.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dedup_cli::console::Console;
use dedup_runtime::inbox::{InboxHandler, InboxMessage};
use serde_json::{Value, json};

use crate::api::{args, serve};
use crate::backends::receive;

/// The W3C element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// ChromeDriver on a free port, stopped on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn driver() -> Driver {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver (Debian's chromium-driver; .ci/run installs it) must be on PATH");
    // Owned at once: killed and waited for on every path, the panic below included.
    let driver = Driver {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    for _ in 0..100 {
        if reqwest::get(format!("{}/status", driver.url)).await.is_ok() {
            return driver;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("chromedriver did not answer on {}", driver.url);
}

/// One browser session.
struct Browser {
    http: reqwest::Client,
    session: String,
}

impl Browser {
    async fn open(driver: &Driver) -> Browser {
        let http = reqwest::Client::new();
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,1000"]
            }
        }}});
        let answer: Value = http
            .post(format!("{}/session", driver.url))
            .json(&capabilities)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = answer["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {answer}"));
        let browser = Browser {
            http,
            session: format!("{}/session/{id}", driver.url),
        };
        // A form's submit returns before the page it loads is there: every lookup waits
        // up to 10 s for its element (a missing one still fails, then).
        browser
            .call(
                reqwest::Method::POST,
                "/timeouts",
                Some(json!({"implicit": 10_000})),
            )
            .await;
        browser
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut request = self.http.request(method, format!("{}{path}", self.session));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        answer["value"].clone()
    }

    async fn go(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url})))
            .await;
    }

    async fn find(&self, css: &str) -> String {
        let found = self
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element `{css}`: {found}"))
            .to_owned()
    }

    async fn text(&self, css: &str) -> String {
        let element = self.find(css).await;
        let text = self
            .call(
                reqwest::Method::GET,
                &format!("/element/{element}/text"),
                None,
            )
            .await;
        text.as_str().unwrap().to_owned()
    }

    async fn click(&self, css: &str) {
        let element = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{element}/click"),
            Some(json!({})),
        )
        .await;
    }

    async fn script(&self, script: &str) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .await
    }

    /// Saves a screenshot of the page as `name.png`.
    async fn screenshot(&self, name: &str) -> PathBuf {
        let shot = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = decode_base64(shot.as_str().unwrap());
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        path
    }

    async fn close(self) {
        let _ = self.http.delete(&self.session).send().await;
    }
}

fn decode_base64(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut buffer, mut bits) = (0u32, 0);
    for byte in text
        .bytes()
        .filter(|b| *b != b'=' && !b.is_ascii_whitespace())
    {
        let value = ALPHABET.iter().position(|c| *c == byte).expect("base64") as u32;
        buffer = (buffer << 6) | value;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buffer >> bits) as u8);
        }
    }
    out
}

/// A handler that cannot parse markup until it is fixed.
struct Parser {
    broken: AtomicBool,
}

impl InboxHandler<sqlx::Sqlite> for Parser {
    type Error = String;

    async fn handle<'c>(
        &'c self,
        tx: &'c mut sqlx::SqliteConnection,
        message: &'c InboxMessage,
    ) -> Result<(), String> {
        if self.broken.load(Ordering::Relaxed) && message.payload().starts_with(b"<script>") {
            return Err("<script>alert('error')</script> is not an order".to_owned());
        }
        sqlx::query("INSERT INTO browser_effects (id) VALUES (?1)")
            .bind(message.id())
            .execute(&mut *tx)
            .await
            .map_err(|error| error.to_string())?;
        Ok(())
    }
}

#[tokio::test]
async fn a_dead_row_is_found_shown_as_text_requeued_and_processed() {
    let db = dedup_suite::sqlite().await;
    // A file of its own: the default table names.
    let inbox_table = dedup_runtime::inbox::DEFAULT_TABLE.to_owned();
    dedup_runtime::inbox::migrate_table(&*db, &inbox_table)
        .await
        .unwrap();
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    sqlx::raw_sql("CREATE TABLE browser_effects (id TEXT PRIMARY KEY)")
        .execute(&*db)
        .await
        .unwrap();
    let orders: Vec<String> = (1..=3).map(|n| format!("order-{n}")).collect();
    receive(
        &*db,
        &inbox_table,
        "orders",
        &orders,
        br#"{"sku": "A-1", "qty": 2}"#,
    )
    .await;
    receive(
        &*db,
        &inbox_table,
        "orders",
        &["order-poison".to_owned()],
        b"<script>alert('payload')</script>",
    )
    .await;
    let inbox = dedup_runtime::inbox::Inbox::new(&*db, "orders")
        .unwrap()
        .in_table(&inbox_table)
        .unwrap();
    let parser = Parser {
        broken: AtomicBool::new(true),
    };
    let report = inbox
        .worker()
        .max_attempts(1)
        .process_batch(&parser)
        .await
        .unwrap();
    assert_eq!(
        (report.processed, report.dead),
        (3, 1),
        "the poison message died"
    );

    let url = format!("sqlite:{}", db.path().display());
    let pools = dedup_cli::Pools::connect(&url, 2).await.unwrap();
    let base = serve(Console::new(
        pools,
        args(&inbox_table, "outbox_messages", "processed_messages"),
    ))
    .await;
    let driver = driver().await;
    let browser = Browser::open(&driver).await;

    // The overview: one dead row, linked.
    browser.go(&format!("{base}/")).await;
    let overview = browser.screenshot("overview").await;
    assert_eq!(browser.text("h1").await, "dedup console");
    browser
        .click(&format!("a[href='/inbox/{inbox_table}?consumer=orders']"))
        .await;

    // The dead row, its payload and error text shown as text: no script on the page.
    let matching = browser.text("#matching").await;
    assert_eq!(matching, "1 dead row matches.");
    assert_eq!(
        browser.text("pre.payload").await,
        "<script>alert('payload')</script>"
    );
    assert_eq!(
        browser.text("pre.last-error").await,
        "<script>alert('error')</script> is not an order"
    );
    assert_eq!(
        browser.script("return document.scripts.length").await,
        json!(0)
    );
    let alert = browser
        .call(reqwest::Method::GET, "/alert/text", None)
        .await;
    assert_eq!(alert["error"], "no such alert", "no script ran: {alert}");
    let dead = browser.screenshot("dead-rows").await;

    // Selected and requeued.
    let row = browser.find("input[name='row']").await;
    browser
        .call(
            reqwest::Method::POST,
            &format!("/element/{row}/click"),
            Some(json!({})),
        )
        .await;
    browser.click("#requeue-selected").await;
    assert_eq!(
        browser.text("#result").await,
        "1 of 1 matching dead rows re-queued."
    );
    let result = browser.screenshot("requeued").await;
    let state: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT state FROM {inbox_table} WHERE message_id = 'order-poison'"
    )))
    .fetch_one(&*db)
    .await
    .unwrap();
    assert_eq!(state, 0, "pending again");

    // The fixed worker processes it; the overview shows it.
    parser.broken.store(false, Ordering::Relaxed);
    let report = inbox.worker().process_batch(&parser).await.unwrap();
    assert_eq!(report.processed, 1);
    browser.go(&format!("{base}/")).await;
    let cells = browser
        .script("return [...document.querySelectorAll('table')[0].rows[1].cells].map(c => c.textContent)")
        .await;
    assert_eq!(
        cells,
        json!(["orders", "0", "0", "4", "0", "-"]),
        "4 processed, none dead"
    );
    let after = browser.screenshot("processed").await;
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM browser_effects")
        .fetch_one(&*db)
        .await
        .unwrap();
    assert_eq!(effects, 4, "every order's effect once");
    browser.close().await;
    for path in [overview, dead, result, after] {
        assert!(
            std::fs::metadata(&path).unwrap().len() > 1_000,
            "{}",
            path.display()
        );
    }
}
