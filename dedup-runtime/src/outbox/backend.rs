//! The outbox's concern trait: how one backend stores, claims and marks outgoing
//! messages ([`OutboxBackend`]).

use super::*;

/// How one backend stores outgoing messages. Part of [`Backend`].
pub trait OutboxBackend: Database {
    /// The statements that create the outbox table and its indexes.
    #[doc(hidden)]
    fn outbox_ddl(table: &Table) -> Vec<String>;

    /// Runs [`OutboxBackend::outbox_ddl`], serialised against concurrent migrations.
    #[doc(hidden)]
    fn outbox_create<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Inserts `row` on the caller's connection, never aborting its transaction; when a
    /// row with its id exists, reads that row's destination and payload instead.
    #[doc(hidden)]
    fn outbox_insert<'c>(
        conn: &'c mut Self::Connection,
        table: &'c Table,
        row: &'c Row<'c>,
    ) -> impl Future<Output = Result<Inserted, sqlx::Error>> + Send + 'c;

    /// The claimed rows of every claim whose lease ended (at most 1,000), grouped by
    /// owner, each owner's in the claim's order (`seq`). A claim's rows share its lease,
    /// but each row's end is its own reading of the clock: one row's lease ended is the
    /// claim's.
    #[doc(hidden)]
    fn outbox_expired<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<Vec<ExpiredOutgoing>, sqlx::Error>> + Send + 'a;

    /// Takes back the rows of `owner`'s claim, whose lease ended: `first`, the row it had
    /// in hand, keeps its counted attempt, and is dead with [`STOPPED`] when `dead`,
    /// unsent again otherwise; the others are unsent again, their attempt given back. In
    /// one transaction, each statement fenced by the owner token. Whether `first` was
    /// taken.
    #[doc(hidden)]
    fn outbox_reclaim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        first: OutgoingId,
        dead: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Claims up to `limit` unsent rows that are due, the head of each ordering key only,
    /// for `owner`, counting their attempt, committed; in the claim's order (`seq`).
    #[doc(hidden)]
    fn outbox_claim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        lease_us: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, sqlx::Error>> + Send + 'a;

    /// The rows `owner` holds claimed, in the claim's order: a claim tried again after its
    /// reply was lost finds the rows it took (their attempt counted once).
    #[doc(hidden)]
    fn outbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, sqlx::Error>> + Send + 'a;

    /// The heartbeat: `owner`'s claimed rows get a lease of `lease_us` from now; how many.
    #[doc(hidden)]
    fn outbox_renew<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        lease_us: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Marks the rows `ids` (at most 1,000) sent, those still `owner`'s claim, in one
    /// statement; how many. A sent row keeps the owner token (its lease is cleared), so
    /// that a mark tried again can count what the lost try marked
    /// ([`outbox_sent_count`](Self::outbox_sent_count)).
    #[doc(hidden)]
    fn outbox_sent<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        ids: &'a [OutgoingId],
        owner: &'a Owner,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// How many of the rows `ids` are sent under `owner`'s claim: what a mark tried again
    /// after its reply was lost counts (the lost try's rows included; a row keeps its
    /// claim's owner token once sent).
    #[doc(hidden)]
    fn outbox_sent_count<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        ids: &'a [OutgoingId],
        owner: &'a Owner,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// After a failed send: the row back to unsent after `delay_us` (or dead), with
    /// `error` as its last error, if it is still `owner`'s claim; whether it was.
    #[doc(hidden)]
    fn outbox_fail<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        id: OutgoingId,
        owner: &'a Owner,
        error: &'a str,
        delay_us: i64,
        dead: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The relay's sign of life: the relay table's one row gets the database's now.
    #[doc(hidden)]
    fn outbox_seen<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Unsent, claimed, sent and dead rows, the microseconds since the oldest unsent row
    /// was enqueued, and since a relay last ran.
    #[doc(hidden)]
    fn outbox_stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<StatsRow, sqlx::Error>> + Send + 'a;

    /// Deletes up to `limit` rows sent more than `older_than_us` ago; how many.
    #[doc(hidden)]
    fn outbox_prune<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        older_than_us: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Dead rows, oldest first: id, destination, attempts, last error.
    #[doc(hidden)]
    fn outbox_dead<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<DeadOutgoing>, sqlx::Error>> + Send + 'a;

    /// The dead row `id` unsent again, due now, its attempts back to 0 (`requeue`), or
    /// recorded as sent without sending; whether it was dead.
    #[doc(hidden)]
    fn outbox_resolve<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        id: OutgoingId,
        requeue: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Releases `owner`'s claimed rows unsent: unsent again, their attempt not counted;
    /// how many.
    #[doc(hidden)]
    fn outbox_release<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;
}
