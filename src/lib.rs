//! Shared helpers of dedup's own integration tests and examples. Not published.
//!
//! The servers are the machine's: PostgreSQL on 127.0.0.1:5432 and MariaDB on
//! 127.0.0.1:3306 (override with `DEDUP_TEST_POSTGRES_URL` / `DEDUP_TEST_MYSQL_URL`).
//! A server that cannot be reached fails the test that needs it, loudly: tests never skip.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Pool;
use sqlx::mysql::MySqlPool;
use sqlx::pool::PoolOptions;
use sqlx::postgres::PgPool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

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

/// A pool on a fresh SQLite file in the temporary directory (WAL, 8 connections), with
/// `processed_messages` migrated. The file is removed when the [`TempSqlite`] is dropped.
pub async fn sqlite() -> TempSqlite {
    let path = std::env::temp_dir().join(format!("dedup-test-{}.db", unique("db")));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("open a SQLite file in the temporary directory");
    dedup_runtime::migrate(&pool).await.expect("migrate SQLite");
    TempSqlite { pool, path }
}

/// A SQLite pool on a temporary file, deleted on drop.
pub struct TempSqlite {
    /// The pool.
    pub pool: SqlitePool,
    path: PathBuf,
}

impl std::ops::Deref for TempSqlite {
    type Target = SqlitePool;
    fn deref(&self) -> &SqlitePool {
        &self.pool
    }
}

impl Drop for TempSqlite {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.path.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
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
