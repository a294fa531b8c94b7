//! Shared helpers of dedup's own integration tests, examples and benchmark. Not published.
//!
//! The servers are the machine's: PostgreSQL on 127.0.0.1:5432 and MariaDB on
//! 127.0.0.1:3306 (override with `DEDUP_TEST_POSTGRES_URL` / `DEDUP_TEST_MYSQL_URL`).
//! A server that cannot be reached fails the test that needs it, loudly: tests never skip.
//!
//! | helper | what for |
//! | --- | --- |
//! | [`postgres`], [`mysql`], [`sqlite`], [`sqlite_with`], [`sqlite_journal`] | a migrated pool on each backend (SQLite: a temporary file, [`TempSqlite`]) |
//! | [`claims`], [`claims_in`] | dedup rows of one `(consumer, message_id)` |
//! | [`rows`] | rows of a test's own table whose column has a value (its effects) |
//! | [`ddl`], [`ddl_lock`] | test tables created one at a time |
//! | [`error_code`] | a database error's vendor code, for assertions |
//! | [`unique`], [`unique_table`] | names no other test or run uses |
//! | [`schema_0_1`] | the dedup table's DDL as 0.1 shipped it, frozen (upgrade tests) |
//! | [`Runs`] | counts the runs of a handler's body (retries re-run it) |
//! | [`Shuffle`] | a reproducible shuffle of deliveries |
//! | `partner` (feature `http`) | a stand-in payment provider: an HTTP server on loopback that honours `Idempotency-Key` (or ignores it) |
//! | `jetstream::streams` (feature `brokers`) | the JetStream streams of `examples/nats.rs`: a stream and its dead-letter stream |
//! | `mosquitto::Mosquitto` (feature `brokers`) | a Mosquitto of the test's own on a free port: restarted, paused, killed when dropped |
//! | `consumer` | what the broker examples share: settings from the environment, idle tracking, the lines the crash harness reads |
//! | `fault::FaultProxy` | a TCP proxy between a pool and its server that loses one reply or cuts one request on cue |
//! | `outage::Outage` | a TCP proxy that cuts every connection to a server, or stalls them, until restored: a broker restart, a cut network, a server that stopped answering |
//! | `rabbitmq::declare` (feature `brokers`) | the RabbitMQ topology of `examples/rabbitmq.rs`: a queue, its dead-letter exchange and queue |

#![warn(missing_docs)]

pub mod consumer;
pub mod fault;
#[cfg(feature = "brokers")]
pub mod jetstream;
#[cfg(feature = "brokers")]
pub mod mosquitto;
pub mod outage;
#[cfg(feature = "http")]
pub mod partner;
#[cfg(feature = "brokers")]
pub mod rabbitmq;
pub mod tansu;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::mysql::{MySql, MySqlDatabaseError, MySqlPool};
use sqlx::pool::PoolOptions;
use sqlx::postgres::{PgPool, Postgres};
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions,
};
use sqlx::{AssertSqlSafe, Connection as _, Pool};

/// PostgreSQL used by the tests.
pub fn postgres_url() -> String {
    std::env::var("DEDUP_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// MariaDB (or MySQL) used by the tests.
pub fn mysql_url() -> String {
    std::env::var("DEDUP_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A pool on the test PostgreSQL, with `processed_messages` migrated.
///
/// # Panics
/// When the server cannot be reached: the message says how to start it.
pub async fn postgres() -> PgPool {
    server("PostgreSQL", &postgres_url(), "DEDUP_TEST_POSTGRES_URL").await
}

/// A pool on the test MariaDB, with `processed_messages` migrated.
///
/// # Panics
/// When the server cannot be reached: the message says how to start it.
pub async fn mysql() -> MySqlPool {
    server("MariaDB", &mysql_url(), "DEDUP_TEST_MYSQL_URL").await
}

/// A pool on the test MariaDB whose sessions run with `sql_mode = ''` (MySQL 5.6's
/// default, still common): a value too long for its column is cut, not refused. For the
/// limits' tests, which must see a value stored whole there too. Not migrated.
///
/// # Panics
/// When the server cannot be reached.
pub async fn mysql_lenient() -> MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(conn, "SET SESSION sql_mode = ''").await?;
                Ok(())
            })
        })
        .connect(&mysql_url())
        .await
        .unwrap_or_else(|error| panic!("MariaDB is not reachable at {}: {error}", mysql_url()))
}

/// A pool of 12 on the server at `url`, migrated; a loud failure when it is unreachable.
async fn server<DB: dedup_runtime::Backend>(name: &str, url: &str, variable: &str) -> Pool<DB> {
    let pool = PoolOptions::<DB>::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(20))
        .connect(url)
        .await
        .unwrap_or_else(|error| {
            panic!("{name} is not reachable at {url}: {error}. Start it (see .ci/run) or set {variable}")
        });
    dedup_runtime::migrate(&pool)
        .await
        .unwrap_or_else(|error| panic!("migrate {name}: {error}"));
    pool
}

/// A pool on a fresh SQLite file in the temporary directory (WAL, 8 connections, a busy
/// timeout of 10 s), with `processed_messages` migrated. The file is removed when the
/// [`TempSqlite`] is dropped.
pub async fn sqlite() -> TempSqlite {
    sqlite_with(8, Duration::from_secs(10)).await
}

/// Like [`sqlite`], with `max_connections` in the pool and each connection's
/// `busy_timeout`: one connection for a test about what happens to *the* connection, a
/// short timeout for a test that holds the write lock elsewhere.
///
/// # Panics
/// When the file cannot be created or migrated.
pub async fn sqlite_with(max_connections: u32, busy_timeout: Duration) -> TempSqlite {
    sqlite_journal(max_connections, busy_timeout, SqliteJournalMode::Wal).await
}

/// Like [`sqlite_with`], in `journal` mode: [`SqliteJournalMode::Delete`] (a rollback
/// journal) for a test that needs readers to block a writer's `COMMIT`, which WAL never
/// does.
///
/// # Panics
/// When the file cannot be created or migrated.
pub async fn sqlite_journal(
    max_connections: u32,
    busy_timeout: Duration,
    journal: SqliteJournalMode,
) -> TempSqlite {
    let path = std::env::temp_dir().join(format!("dedup-test-{}.db", unique("db")));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(journal)
        .busy_timeout(busy_timeout);
    let pool = SqlitePoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options.clone())
        .await
        .expect("open a SQLite file in the temporary directory");
    dedup_runtime::migrate(&pool).await.expect("migrate SQLite");
    TempSqlite {
        pool,
        options,
        path,
    }
}

/// A SQLite pool on a temporary file, deleted on drop.
pub struct TempSqlite {
    /// The pool.
    pub pool: SqlitePool,
    options: SqliteConnectOptions,
    path: PathBuf,
}

impl TempSqlite {
    /// Another connection to the same file, outside the pool (with the pool's options),
    /// e.g. to hold the write lock while the pool's connections wait for it.
    ///
    /// # Panics
    /// When the file cannot be opened.
    pub async fn connect(&self) -> SqliteConnection {
        SqliteConnection::connect_with(&self.options)
            .await
            .expect("open the temporary SQLite file again")
    }
}

impl TempSqlite {
    /// The database file.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl std::ops::Deref for TempSqlite {
    type Target = SqlitePool;
    fn deref(&self) -> &SqlitePool {
        &self.pool
    }
}

impl Drop for TempSqlite {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut path = self.path.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The three backends as the helpers query them: PostgreSQL numbers its placeholders,
/// MariaDB and SQLite take `?`.
pub trait TestDatabase: dedup_runtime::Backend {
    /// The placeholders of a statement's first and second bound values.
    const PLACEHOLDERS: [&'static str; 2];

    /// Runs `sql`, a `COUNT(*)` with `binds` bound in order, and returns the count.
    ///
    /// # Panics
    /// When the statement fails.
    fn count(
        pool: &Pool<Self>,
        sql: String,
        binds: Vec<String>,
    ) -> impl Future<Output = i64> + Send;

    /// Runs `sql` (one or more statements), with whatever the backend needs so that
    /// concurrent runs of the same DDL do not race.
    ///
    /// # Panics
    /// When the statements fail.
    fn execute_ddl(pool: &Pool<Self>, sql: String) -> impl Future<Output = ()> + Send;
}

/// A key for `pg_advisory_xact_lock`: the suite's DDL, one process at a time.
const DDL_ADVISORY_KEY: i64 = 0x0de0_d0dd_1001;

macro_rules! test_database {
    ($db:ty, [$first:literal, $second:literal], |$pool:ident, $sql:ident| $ddl:expr) => {
        impl TestDatabase for $db {
            const PLACEHOLDERS: [&'static str; 2] = [$first, $second];

            async fn count(pool: &Pool<Self>, sql: String, binds: Vec<String>) -> i64 {
                let mut query = sqlx::query_scalar(AssertSqlSafe(sql.clone()));
                for bind in binds {
                    query = query.bind(bind);
                }
                query
                    .fetch_one(pool)
                    .await
                    .unwrap_or_else(|error| panic!("{sql}: {error}"))
            }

            async fn execute_ddl($pool: &Pool<Self>, $sql: String) {
                let statements = $ddl;
                sqlx::raw_sql(AssertSqlSafe(statements))
                    .execute($pool)
                    .await
                    .unwrap_or_else(|error| panic!("{}: {error}", $sql));
            }
        }
    };
}

// `CREATE … IF NOT EXISTS` from two sessions at once races on PostgreSQL's catalog (a
// unique violation on `pg_type`), also between processes: the statements run in one
// implicit transaction that first takes an advisory lock.
test_database!(Postgres, ["$1", "$2"], |pool, sql| format!(
    "SELECT pg_advisory_xact_lock({DDL_ADVISORY_KEY}); {sql}"
));
test_database!(MySql, ["?", "?"], |pool, sql| sql.clone());
test_database!(Sqlite, ["?", "?"], |pool, sql| sql.clone());

/// Dedup rows of `(consumer, id)` in `processed_messages`: 1 once the message was
/// processed and committed, 0 before and after anything that must leave nothing.
pub async fn claims<DB: TestDatabase>(pool: &Pool<DB>, consumer: &str, id: &str) -> i64 {
    claims_in(pool, dedup_runtime::DEFAULT_TABLE, consumer, id).await
}

/// Dedup rows of `(consumer, id)` in the dedup table `table` (a name the test chose).
pub async fn claims_in<DB: TestDatabase>(
    pool: &Pool<DB>,
    table: &str,
    consumer: &str,
    id: &str,
) -> i64 {
    let [first, second] = DB::PLACEHOLDERS;
    let sql =
        format!("SELECT COUNT(*) FROM {table} WHERE consumer = {first} AND message_id = {second}");
    DB::count(pool, sql, vec![consumer.to_owned(), id.to_owned()]).await
}

/// Rows of the test's own `table` whose `column` equals `value`: how many times an
/// effect was applied.
pub async fn rows<DB: TestDatabase>(
    pool: &Pool<DB>,
    table: &str,
    column: &str,
    value: &str,
) -> i64 {
    let [first, _] = DB::PLACEHOLDERS;
    let sql = format!("SELECT COUNT(*) FROM {table} WHERE {column} = {first}");
    DB::count(pool, sql, vec![value.to_owned()]).await
}

/// The lock that runs the suite's DDL one test at a time within a process (tests run in
/// parallel threads). Hold it around DDL that [`ddl`] cannot run, such as
/// `dedup_runtime::migrate_table`.
pub async fn ddl_lock() -> tokio::sync::MutexGuard<'static, ()> {
    static DDL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    DDL.lock().await
}

/// Runs a test's DDL (`CREATE TABLE IF NOT EXISTS …`, one or more statements) one test at
/// a time: under [`ddl_lock`], and on PostgreSQL under an advisory lock too, against other
/// processes running the suite on the same server.
///
/// # Panics
/// When the statements fail.
pub async fn ddl<DB: TestDatabase>(pool: &Pool<DB>, sql: &str) {
    let _one_at_a_time = ddl_lock().await;
    DB::execute_ddl(pool, sql.to_owned()).await;
}

/// The path of the example binary `name`, after building `examples` (the package's
/// examples) once per test process and set of examples, with the test's own profile and
/// features plus `feature` (none when empty; a no-op when `cargo test` has just built
/// them). For crash harnesses that run an example as a child process.
///
/// With `DEDUP_PREBUILT_EXAMPLES=1` in the environment it calls no cargo and takes the
/// binaries in `target/<profile>/examples` as they are: for a run whose examples were
/// built by the same `cargo test --workspace --all-features` that built the tests (cargo
/// builds a package's examples with its tests), as `.ci/run` does before it runs them
/// beside its lint steps. A cargo build here would wait on the build directory's lock
/// for as long as one of those steps compiles.
///
/// # Panics
/// When cargo fails, or the binary is not where cargo puts it.
pub fn example_binary(feature: &str, examples: &[&str], name: &str) -> std::path::PathBuf {
    use std::path::Path;
    use std::process::Command;

    let exe = std::env::current_exe().expect("the test executable's path");
    // target/<profile dir>/deps/<test>-…
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable is in target/<profile>/deps")
        .to_path_buf();

    if std::env::var_os("DEDUP_PREBUILT_EXAMPLES").is_some_and(|on| on == "1") {
        let path = profile_dir.join("examples").join(name);
        assert!(
            examples.contains(&name) && path.exists(),
            "DEDUP_PREBUILT_EXAMPLES=1 but {} was not built: build the tests with \
             `cargo test --workspace --all-features --no-run` first, or unset it",
            path.display()
        );
        return path;
    }

    // What was built, per feature and examples: the suites of one test binary ask for
    // different examples, and each must be built (a cache of the first call's alone left
    // the others' binaries as an earlier build had left them, or missing).
    static BUILT: Mutex<BTreeMap<String, std::path::PathBuf>> = Mutex::new(BTreeMap::new());
    let key = format!("{feature}:{}", examples.join(","));
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = built.entry(key).or_insert_with(|| {
        let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
            Some("debug") => "dev".to_owned(),
            Some(other) => other.to_owned(),
            None => panic!("no profile directory above {}", exe.display()),
        };
        let mut cargo = Command::new(env!("CARGO"));
        // `cargo test` runs a test with the package's `CARGO_PKG_*` and `CARGO_MANIFEST_*`
        // set; some build scripts (ring's, for one) watch them, and would be rebuilt here
        // and again by the next ordinary cargo command.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if name.starts_with("CARGO_PKG_")
                || name.starts_with("CARGO_MANIFEST_")
                || matches!(
                    &*name,
                    "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE" | "OUT_DIR"
                )
            {
                cargo.env_remove(&*name);
            }
        }
        cargo
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--profile", &profile]);
        // The features this suite was built with, and `feature`: the same set as the
        // `cargo test` that built the examples, so that this build finds them fresh. With
        // another set, cargo rebuilt the suite's library and the examples (minutes, in a
        // cold CI run), each test binary asking for its own set in turn.
        let mut features = vec![feature];
        if cfg!(feature = "brokers") {
            features.push("brokers");
        }
        if cfg!(feature = "http") {
            features.push("http");
        }
        features.retain(|feature| !feature.is_empty());
        features.sort_unstable();
        features.dedup();
        if !features.is_empty() {
            cargo.args(["--features", &features.join(",")]);
        }
        for example in examples {
            cargo.args(["--example", example]);
        }
        let status = cargo.status().expect("run cargo to build the examples");
        assert!(status.success(), "cargo build of the examples failed");
        profile_dir.join("examples")
    });
    let path = dir.join(name);
    drop(built);
    assert!(path.exists(), "{} was not built", path.display());
    path
}

/// The vendor code of a database error, as tests assert it: the SQLSTATE on PostgreSQL,
/// the error number on MariaDB/MySQL (`1213`: more precise than its SQLSTATE), SQLite's
/// extended result code. `None` for an error that is not the database's.
pub fn error_code(error: &sqlx::Error) -> Option<String> {
    let database = error.as_database_error()?;
    if let Some(mysql) = database.try_downcast_ref::<MySqlDatabaseError>() {
        return Some(mysql.number().to_string());
    }
    database.code().map(|code| code.into_owned())
}

/// A name no other test, run or process uses: `prefix-<time>-<pid>-<counter>`.
///
/// The dedup table outlives a test run on the servers, so every test draws its message
/// ids from here.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    format!(
        "{prefix}-{nanos:x}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A table name no other test, run or process uses: [`unique`] as an SQL identifier.
pub fn unique_table(prefix: &str) -> String {
    unique(prefix).replace('-', "_")
}

/// Counts the runs of a handler's body: a retry runs the whole body again.
#[derive(Debug, Default)]
pub struct Runs(AtomicU32);

impl Runs {
    /// A counter at zero.
    pub fn new() -> Self {
        Runs::default()
    }

    /// A counter at `runs`.
    pub fn starting_at(runs: u32) -> Self {
        Runs(AtomicU32::new(runs))
    }

    /// Counts a run; returns its 1-based number.
    pub fn next(&self) -> u32 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The runs so far.
    pub fn get(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A small deterministic generator (xorshift64*), for shuffling deliveries reproducibly.
pub struct Shuffle(u64);

impl Shuffle {
    /// A generator seeded with `seed` (any value; 0 is remapped).
    pub fn new(seed: u64) -> Self {
        Shuffle(seed.max(1))
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = usize::try_from(self.next_u64() % (i as u64 + 1)).unwrap_or(0);
            items.swap(i, j);
        }
    }
}

/// A crash harness's size from the environment: `name` parsed, or `default` when it is
/// unset or not a number.
pub fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// A crash harness's seed for its random choices: `DEDUP_CRASH_SEED`, or the clock (a run
/// prints its seed, so that `DEDUP_CRASH_SEED` repeats it).
pub fn crash_seed() -> u64 {
    std::env::var("DEDUP_CRASH_SEED")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |elapsed| elapsed.as_nanos() as u64)
        })
}

/// Holds a leased handler's body until the test lets it go, and says when it is in: a
/// copy of the message can then arrive while the lease runs.
#[derive(Default)]
pub struct Gate {
    /// Whether [`pass`](Self::pass) waits (a [`Default`] gate is open).
    pub hold: bool,
    /// Notified when a body reaches [`pass`](Self::pass).
    pub entered: tokio::sync::Notify,
    /// Notify it to let the body go on.
    pub go: tokio::sync::Notify,
}

impl Gate {
    /// A gate that holds the body until [`go`](Self::go) is notified.
    pub fn held() -> std::sync::Arc<Gate> {
        std::sync::Arc::new(Gate {
            hold: true,
            ..Gate::default()
        })
    }

    /// In the body: says it is in, then waits for [`go`](Self::go) (a held gate).
    pub async fn pass(&self) {
        if self.hold {
            self.entered.notify_one();
            self.go.notified().await;
        }
    }
}

/// The dedup table as dedup 0.1 created it (its `migrate` and its shipped
/// `0001_processed_messages.sql`), frozen here: the starting point of the upgrade tests,
/// and what the shipped `0001` files must go on saying. Never change these strings.
pub mod schema_0_1 {
    /// PostgreSQL's 0.1 DDL for `table` (unqualified), one script.
    pub fn postgres(table: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (\n    \
             consumer     text COLLATE \"C\" NOT NULL,\n    \
             message_id   text COLLATE \"C\" NOT NULL,\n    \
             processed_at timestamptz NOT NULL DEFAULT now(),\n    \
             PRIMARY KEY (consumer, message_id)\n);\n\
             CREATE INDEX IF NOT EXISTS {table}_processed_at_idx ON {table} (processed_at);\n"
        )
    }

    /// MySQL and MariaDB's 0.1 DDL for `table` (unqualified), one script.
    pub fn mysql(table: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (\n    \
             consumer     VARBINARY(255) NOT NULL,\n    \
             message_id   VARBINARY(255) NOT NULL,\n    \
             processed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             PRIMARY KEY (consumer, message_id),\n    \
             KEY processed_at_idx (processed_at)\n\
             ) ENGINE = InnoDB;\n\
             ALTER TABLE {table} ALTER COLUMN processed_at SET DEFAULT (UTC_TIMESTAMP(6));\n"
        )
    }

    /// SQLite's 0.1 DDL for `table` (unqualified), one script.
    pub fn sqlite(table: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (\n    \
             consumer     TEXT NOT NULL,\n    \
             message_id   TEXT NOT NULL,\n    \
             processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),\n    \
             PRIMARY KEY (consumer, message_id)\n\
             ) WITHOUT ROWID;\n\
             CREATE INDEX IF NOT EXISTS {table}_processed_at_idx ON {table} (processed_at);\n"
        )
    }
}

/// The README's Rust snippets, compiled and run as this crate's doctests: each one shows
/// the context it needs, or hides it behind `#` (rustdoc's hidden lines).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct Readme;

/// The READMEs of the published crates that use other crates of the workspace in their
/// snippets (`dedup-macros`' shows the attribute through `dedup-runtime`; `dedup-limits`'
/// compares with the runtime's constants), compiled here, where both are dependencies.
/// `dedup-runtime`'s own README is a doctest of that crate.
#[cfg(doctest)]
#[doc = include_str!("../dedup-macros/README.md")]
pub struct MacrosReadme;

/// See [`MacrosReadme`].
#[cfg(doctest)]
#[doc = include_str!("../dedup-limits/README.md")]
pub struct LimitsReadme;

// The guide (`guide/`, an mdBook): every chapter's Rust blocks are doctests too, as the
// README's are. `tests/guide.rs` checks that each chapter is listed here.

/// The guide's chapter "Effectively-once and the common mistakes"
/// (`guide/src/introduction.md`), its Rust snippets compiled and run as doctests, as
/// [`Readme`]'s are; one item per chapter below.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/introduction.md")]
pub struct GuideIntroduction;

/// The guide's chapter "Handlers and their contract" (`guide/src/handlers.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/handlers.md")]
pub struct GuideHandlers;

/// The guide's chapter "Business keys" (`guide/src/business-keys.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/business-keys.md")]
pub struct GuideBusinessKeys;

/// The guide's chapter "Effects outside the database" (`guide/src/effects.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/effects.md")]
pub struct GuideEffects;

/// The guide's chapter "Stored results and fingerprints" (`guide/src/results.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/results.md")]
pub struct GuideResults;

/// The guide's chapter "The inbox" (`guide/src/inbox.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/inbox.md")]
pub struct GuideInbox;

/// The guide's chapter "The outbox and the relay" (`guide/src/outbox.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/outbox.md")]
pub struct GuideOutbox;

/// The guide's chapter "Batches" (`guide/src/batches.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/batches.md")]
pub struct GuideBatches;

/// The guide's chapter "Hosted consumers" (`guide/src/consumers.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/consumers.md")]
pub struct GuideConsumers;

/// The guide's chapter "RabbitMQ" (`guide/src/brokers/rabbitmq.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/brokers/rabbitmq.md")]
pub struct GuideRabbitMq;

/// The guide's chapter "NATS JetStream" (`guide/src/brokers/nats.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/brokers/nats.md")]
pub struct GuideNats;

/// The guide's chapter "Kafka" (`guide/src/brokers/kafka.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/brokers/kafka.md")]
pub struct GuideKafka;

/// The guide's chapter "Redis Streams" (`guide/src/brokers/redis.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/brokers/redis.md")]
pub struct GuideRedis;

/// The guide's chapter "MQTT" (`guide/src/brokers/mqtt.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/brokers/mqtt.md")]
pub struct GuideMqtt;

/// The guide's chapter on HTTP idempotency keys, its Rust blocks compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/http.md")]
pub struct GuideHttp;

/// The guide's chapter "Operating it" (`guide/src/operating.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/operating.md")]
pub struct GuideOperating;

/// The guide's chapter "Performance" (`guide/src/performance.md`), as doctests.
#[cfg(doctest)]
#[doc = include_str!("../guide/src/performance.md")]
pub struct GuidePerformance;
