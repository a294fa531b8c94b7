//! The inbox's concern traits: how one backend stores, claims and marks inbox rows
//! ([`InboxBackend`]), and the operator's calls ([`InboxOperatorBackend`]).

use super::*;

/// How one backend stores inbox rows. Part of [`Backend`].
pub trait InboxBackend: Database {
    /// The statements that create the inbox table and its indexes.
    #[doc(hidden)]
    fn inbox_ddl(table: &Table) -> Vec<String>;

    /// Runs [`InboxBackend::inbox_ddl`], serialised against concurrent migrations.
    #[doc(hidden)]
    fn inbox_create<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Inserts `rows` (distinct ids, at most [`MAX_BATCH`]) in one statement; for each,
    /// whether it was stored (`false`: the inbox held it already).
    #[doc(hidden)]
    fn inbox_insert<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        rows: &'a [Row<'a>],
    ) -> impl Future<Output = Result<Vec<bool>, sqlx::Error>> + Send + 'a;

    /// The stored fingerprint of each of `ids` that has a row (`None`: stored without).
    #[doc(hidden)]
    fn inbox_fingerprints<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        ids: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<StoredFingerprint>, sqlx::Error>> + Send + 'a;

    /// The claimed rows of every claim whose lease ended (at most [`MAX_BATCH`]), grouped
    /// by owner, each owner's in the claim's order (due time, then receive order). A
    /// claim's rows share its lease, but each row's end is its own reading of the clock:
    /// one row's lease ended is the claim's.
    #[doc(hidden)]
    fn inbox_expired<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
    ) -> impl Future<Output = Result<Vec<Expired>, sqlx::Error>> + Send + 'a;

    /// Takes back the rows of `owner`'s claim, whose lease ended: `first`, the row it had
    /// in hand, keeps its counted attempt, and is dead with [`STOPPED`] when `dead` (it was
    /// the last), pending again otherwise; the others are pending again, their attempt
    /// given back. In one transaction, each statement fenced by the owner token, so that
    /// two workers taking back at once change each row once. Whether `first` was taken.
    #[doc(hidden)]
    fn inbox_reclaim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        first: &'a str,
        dead: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Claims up to `limit` pending rows that are due (the head of each ordering key) for
    /// `owner`, counting their attempt; in the claim's order (due time, then receive
    /// order). Also whether a claim's lease had ended (a row claimed, its lease past):
    /// rows for [`InboxBackend::inbox_expired`] to find — PostgreSQL in the claim's own
    /// statement, the others in a look along the lease index first.
    /// On `conn`, which the worker then keeps for the claim's first transaction (one
    /// acquire, and the pool's ping, fewer per claim).
    #[doc(hidden)]
    fn inbox_claim<'a>(
        conn: &'a mut Self::Connection,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
        limit: u32,
    ) -> impl Future<Output = Result<(Vec<InboxMessage>, bool), sqlx::Error>> + Send + 'a;

    /// The rows `owner` holds claimed, in the claim's order: a claim tried again after its
    /// reply was lost finds the rows it took (their attempt counted once).
    #[doc(hidden)]
    fn inbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
    ) -> impl Future<Output = Result<Vec<InboxMessage>, sqlx::Error>> + Send + 'a;

    /// Begins the processing transaction, in the round trip of its `BEGIN`, with what
    /// the transaction is checked by before its mark commits: PostgreSQL a
    /// transaction-local setting, MySQL a savepoint. Neither checks the claim nor takes a
    /// lock on the row, so that a worker paused mid-handler past its lease loses the row to
    /// another (the finishing mark refuses it). SQLite, whose writer excludes every other,
    /// marks the row here. The `bool`: whether the claim may still be ours (`false`: it
    /// was lost, run nothing).
    #[doc(hidden)]
    fn inbox_begin<'c>(
        conn: &'c mut Self::Connection,
        row: &'c Claimed<'c>,
    ) -> impl Future<Output = Result<(sqlx::Transaction<'c, Self>, bool), sqlx::Error>> + Send + 'c;

    /// After the handler, before the commit: marks the row processed if it is still
    /// `row.owner`'s (`false`: the claim was lost, roll back). If the transaction that
    /// [`InboxBackend::inbox_begin`] began is gone — a deadlock rollback the handler
    /// swallowed, a `ROLLBACK` it sent — this or the commit after it (MySQL: the commit,
    /// which releases the savepoint first) fails with [`RolledBack`](crate::RolledBack),
    /// so that a mark never commits without the handler's effects.
    #[doc(hidden)]
    fn inbox_finish<'c>(
        conn: &'c mut Self::Connection,
        row: &'c Claimed<'c>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// [`InboxBackend::inbox_begin`] for a batch processed in one transaction, and the ids
    /// the handler may run on: PostgreSQL and MySQL check nothing here (`None`: all of
    /// `rows.ids`); SQLite marks the rows still `rows.owner`'s, and returns those.
    #[doc(hidden)]
    fn inbox_begin_many<'c>(
        conn: &'c mut Self::Connection,
        rows: &'c ClaimedMany<'c>,
    ) -> impl Future<
        Output = Result<(sqlx::Transaction<'c, Self>, Option<Vec<String>>), sqlx::Error>,
    > + Send
    + 'c;

    /// [`InboxBackend::inbox_finish`] for a batch: marks `rows.ids` processed where they
    /// are still `rows.owner`'s, in one statement; how many were (fewer than all: a claim
    /// was lost, roll back). [`RolledBack`](crate::RolledBack) if the transaction is gone.
    #[doc(hidden)]
    fn inbox_finish_many<'c>(
        conn: &'c mut Self::Connection,
        rows: &'c ClaimedMany<'c>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'c;

    /// The heartbeat: `owner`'s claimed rows get a lease of `lease_us` from now; how many.
    #[doc(hidden)]
    fn inbox_renew<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// After a failed attempt: the row back to pending after `delay_us` (or dead), with
    /// `error` as its last error, if it is still `row.owner`'s; whether it was.
    #[doc(hidden)]
    fn inbox_fail<'a>(
        pool: &'a Pool<Self>,
        row: &'a Claimed<'a>,
        error: &'a str,
        delay_us: i64,
        dead: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Releases `owner`'s claimed rows unstarted, all but `except` (the message in hand;
    /// `""`, which no message id is, for none): pending again, their attempt not counted;
    /// how many.
    #[doc(hidden)]
    fn inbox_release<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        except: &'a str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;
}

/// What [`InboxBackend::inbox_stats`] reads: pending, claimed, processed, dead, and the
/// microseconds since the oldest pending row was received.
#[doc(hidden)]
pub type StatsRow = (i64, i64, i64, i64, Option<i64>);

/// The operator's side of the inbox, per backend.
pub trait InboxOperatorBackend: Database {
    /// Dead rows, oldest first: id, attempts, last error.
    #[doc(hidden)]
    fn inbox_dead<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<(String, i64, Option<String>)>, sqlx::Error>> + Send + 'a;

    /// A dead row back to pending (`requeue`), or recorded processed without running
    /// (`!requeue`); whether there was such a dead row.
    #[doc(hidden)]
    fn inbox_resolve<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
        requeue: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Deletes up to `batch` processed rows of `consumer` processed more than `age_us`
    /// ago (the database's clock); how many.
    #[doc(hidden)]
    fn inbox_prune<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        age_us: i64,
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Pending and claimed rows of `consumer`, counted up to `limit`.
    #[doc(hidden)]
    fn inbox_backlog<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

    /// The counts by state, and the age of the oldest pending row.
    #[doc(hidden)]
    fn inbox_stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
    ) -> impl Future<Output = Result<StatsRow, sqlx::Error>> + Send + 'a;
}
