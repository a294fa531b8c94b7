//! The targets, PostgreSQL, SQLite and MariaDB (the per-message group's only), written
//! once.
//!
//! What differs between them is [`Sql`], implemented in `postgres.rs`, `sqlite.rs` and
//! `mysql.rs`: the text of the statements, how a hand-written transaction begins, and the
//! few statements of a shape of their own (the big table's fill, the batch body's
//! multi-row insert, the ids marked seen). Their `#[idempotent]` handlers are
//! [`Handlers`], stamped out for each by [`handlers!`], since the attribute needs a named
//! connection type. The rest — the body, the hand-written and bare transactions, the
//! variants' dispatch, the outbox rows, the inbox and batch handlers — is [`Target`], one
//! blanket impl for all.

use std::future::Future;

use dedup_runtime::batch::BatchHandler;
use dedup_runtime::inbox::{InboxHandler, InboxMessage};
use dedup_runtime::outbox::OutboxConnection;
use sqlx::{Pool, Transaction};

use crate::config::{BackendName, Variant};
use crate::outbox::enqueue_one;

/// What differs between PostgreSQL, SQLite and MariaDB.
pub(crate) trait Sql: dedup_runtime::Backend {
    /// Its name in the report.
    const BACKEND: BackendName;
    /// The handlers' work, the same in every variant: one row into `dedup_bench_effects`.
    const EFFECT: &'static str;
    /// The hand-written claim: the `INSERT … ON CONFLICT DO NOTHING` (MariaDB: `INSERT
    /// IGNORE`) a person writes (the generated claim on PostgreSQL also stamps the claim's
    /// time and reads a row it finds).
    const CLAIM: &'static str;
    /// Creates `dedup_bench_effects` and `dedup_bench_meta`, if missing.
    const CREATE: [&'static str; 2];
    /// The rows a big table was filled with, from `dedup_bench_meta`.
    const FILLED: &'static str;

    /// Begins a transaction of the hand-written and bare variants.
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_;

    /// The rows a statement changed.
    fn rows_affected(result: &Self::QueryResult) -> u64;

    /// Empties the dedup table and the effects.
    fn reset_sql() -> Vec<String>;

    /// Empties the inbox table and the effects.
    fn inbox_reset_sql() -> Vec<String>;

    /// Empties the outbox table.
    fn outbox_reset_sql() -> Vec<String>;

    /// What follows a bulk delete or fill of `table`, untimed.
    fn tidy(table: &str) -> String;

    /// Fills `big`, just migrated, with `rows` ids, and records it in `dedup_bench_meta`.
    fn fill_big(big: &str, rows: i64) -> Vec<String>;

    /// Fills `dedup_bench_prune` with `rows` ids aged 3 days and up, one a second apart.
    fn fill_prune(rows: i64) -> String;

    /// Records `ids` as processed by the generated handler's consumer, untimed, so that the
    /// duplicate run finds every one of them.
    fn seen<'a>(
        pool: &'a Pool<Self>,
        ids: &'a [String],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The batch handler's work: one multi-row statement for all fresh messages.
    fn insert_effects<'a>(
        tx: &'a mut Self::Connection,
        fresh: &'a [&'a String],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// A backend's `#[idempotent]` handlers ([`handlers!`]): `true` when one processed its
/// message.
pub(crate) trait Handlers: sqlx::Database {
    /// The generated handler, on `dedup_bench`.
    fn generated<'a>(
        pool: &'a Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The same on the big table, `dedup_bench_10m`.
    fn big<'a>(
        pool: &'a Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The same on the smoke run's big table, `dedup_bench_10k`.
    fn big_smoke<'a>(
        pool: &'a Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The same on the pruned table (`dedup_bench_prune`).
    fn consume<'a>(
        pool: &'a Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The generated handler that also enqueues one outgoing message (its own consumer on
    /// the same dedup table).
    fn with_outbox<'a>(
        pool: &'a Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;
}

/// A backend's [`Handlers`], on its connection type (`PgConnection`, `SqliteConnection`,
/// `MySqlConnection`):
/// the `#[idempotent]` functions in a module `handlers` of the invoking file, and the impl.
macro_rules! handlers {
    ($db:ty, $connection:ident) => {
        mod handlers {
            use dedup_runtime::idempotent;
            use sqlx::$connection;

            use crate::target::Target;

            #[idempotent(consumer = "bench", key = id, table = "dedup_bench")]
            pub(super) async fn generated(
                tx: &mut $connection,
                id: &str,
            ) -> Result<(), sqlx::Error> {
                <$db as Target>::body(tx, id).await
            }

            #[idempotent(consumer = "bench", key = id, table = "dedup_bench_10m")]
            pub(super) async fn big(tx: &mut $connection, id: &str) -> Result<(), sqlx::Error> {
                <$db as Target>::body(tx, id).await
            }

            #[idempotent(consumer = "bench", key = id, table = "dedup_bench_10k")]
            pub(super) async fn big_smoke(
                tx: &mut $connection,
                id: &str,
            ) -> Result<(), sqlx::Error> {
                <$db as Target>::body(tx, id).await
            }

            #[idempotent(consumer = "bench-prune", key = id, table = "dedup_bench_prune")]
            pub(super) async fn consume(tx: &mut $connection, id: &str) -> Result<(), sqlx::Error> {
                <$db as Target>::body(tx, id).await
            }

            /// The generated handler's body and one outgoing message.
            #[idempotent(consumer = "bench-outbox", key = id, table = "dedup_bench")]
            pub(super) async fn with_outbox(
                tx: &mut $connection,
                id: &str,
            ) -> Result<(), sqlx::Error> {
                <$db as Target>::body(tx, id).await?;
                crate::outbox::enqueue_one(tx, "bench-outbox", id).await
            }
        }

        impl crate::target::Handlers for $db {
            async fn generated(pool: &sqlx::Pool<$db>, id: &str) -> Result<bool, sqlx::Error> {
                Ok(handlers::generated(pool, id).await?.is_processed())
            }

            async fn big(pool: &sqlx::Pool<$db>, id: &str) -> Result<bool, sqlx::Error> {
                Ok(handlers::big(pool, id).await?.is_processed())
            }

            async fn big_smoke(pool: &sqlx::Pool<$db>, id: &str) -> Result<bool, sqlx::Error> {
                Ok(handlers::big_smoke(pool, id).await?.is_processed())
            }

            async fn consume(pool: &sqlx::Pool<$db>, id: &str) -> Result<bool, sqlx::Error> {
                Ok(handlers::consume(pool, id).await?.is_processed())
            }

            async fn with_outbox(pool: &sqlx::Pool<$db>, id: &str) -> Result<bool, sqlx::Error> {
                Ok(handlers::with_outbox(pool, id).await?.is_processed())
            }
        }
    };
}

pub(crate) use handlers;

/// A backend's handlers, behind one name per variant, and the statements the benchmark
/// sends it: written once, for every backend with [`Sql`] and [`Handlers`].
pub(crate) trait Target: Sql + Handlers {
    /// Runs one call of `variant`; `true` when it processed the message.
    fn call<'a>(
        pool: &'a Pool<Self>,
        variant: Variant,
        smoke: bool,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The handler's work, the same in every variant: [`Sql::EFFECT`].
    fn body<'a>(
        tx: &'a mut Self::Connection,
        id: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// What the generated code sends, written by hand: [`Sql::begin`], then the SQL of
    /// DESIGN.md ([`Sql::CLAIM`], the body, `COMMIT`, or `ROLLBACK` on a duplicate).
    fn handwritten<'a>(
        pool: &'a Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The body alone in a transaction, without dedup.
    fn bare<'a>(
        pool: &'a Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Enqueues one outgoing message per id, 100 per transaction.
    fn enqueue_rows<'a>(
        pool: &'a Pool<Self>,
        ids: &'a [String],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// [`crate::setup::execute`] on this backend.
    fn execute<'a, S: AsRef<str> + Sync>(
        pool: &'a Pool<Self>,
        statements: &'a [S],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The rows `big` was filled with, if it was ([`Sql::FILLED`]).
    fn filled<'a>(
        pool: &'a Pool<Self>,
        big: &'a str,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;
}

impl<DB> Target for DB
where
    DB: Sql + Handlers,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Connection: OutboxConnection,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
{
    async fn call(
        pool: &Pool<DB>,
        variant: Variant,
        smoke: bool,
        id: &str,
    ) -> Result<bool, sqlx::Error> {
        match variant {
            Variant::Generated | Variant::Duplicate => DB::generated(pool, id).await,
            Variant::Big if smoke => DB::big_smoke(pool, id).await,
            Variant::Big => DB::big(pool, id).await,
            Variant::Handwritten => DB::handwritten(pool, id).await,
            Variant::Bare | Variant::Pgbench => DB::bare(pool, id).await,
        }
    }

    async fn body(tx: &mut DB::Connection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query(DB::EFFECT).bind(id).execute(&mut *tx).await?;
        Ok(())
    }

    async fn handwritten(pool: &Pool<DB>, id: &str) -> Result<bool, sqlx::Error> {
        let mut tx = DB::begin(pool).await?;
        let claimed = DB::rows_affected(
            &sqlx::query(DB::CLAIM)
                .bind("bench")
                .bind(id)
                .execute(&mut *tx)
                .await?,
        ) == 1;
        if !claimed {
            tx.rollback().await?;
            return Ok(false);
        }
        DB::body(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn bare(pool: &Pool<DB>, id: &str) -> Result<bool, sqlx::Error> {
        let mut tx = DB::begin(pool).await?;
        DB::body(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn enqueue_rows(pool: &Pool<DB>, ids: &[String]) -> Result<(), sqlx::Error> {
        for chunk in ids.chunks(100) {
            let mut tx = pool.begin().await?;
            for id in chunk {
                enqueue_one(&mut *tx, "bench-relay", id).await?;
            }
            tx.commit().await?;
        }
        Ok(())
    }

    async fn execute<S: AsRef<str> + Sync>(
        pool: &Pool<DB>,
        statements: &[S],
    ) -> Result<(), sqlx::Error> {
        crate::setup::execute(pool, statements).await
    }

    async fn filled(pool: &Pool<DB>, big: &str) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar(DB::FILLED)
            .bind(big)
            .fetch_optional(pool)
            .await
    }
}

/// The inbox workers' handler: the same work as the handlers.
pub(crate) struct InboxBody;

impl<DB: Target> InboxHandler<DB> for InboxBody {
    type Error = sqlx::Error;

    async fn handle(
        &self,
        tx: &mut DB::Connection,
        message: &InboxMessage,
    ) -> Result<(), sqlx::Error> {
        DB::body(tx, message.id()).await
    }
}

/// The batch handler: [`Sql::insert_effects`], one multi-row statement inserting the fresh
/// messages' effects.
pub(crate) struct BatchBody;

impl<DB: Target> BatchHandler<DB, String> for BatchBody {
    type Error = sqlx::Error;

    async fn handle(&self, tx: &mut DB::Connection, fresh: &[&String]) -> Result<(), sqlx::Error> {
        DB::insert_effects(tx, fresh).await
    }
}
