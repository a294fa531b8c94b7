//! MySQL and MariaDB: `VARBINARY` ids (byte order), `LONGBLOB` payloads, times in UTC on
//! the server's clock. No `RETURNING` on MySQL 8 and no way to tell an inserted row from a
//! kept one by the affected-row count of a multi-row insert: each batch carries a random
//! receipt, written only by the rows it inserts (`ON DUPLICATE KEY UPDATE` keeps the old
//! row as it was), and the rows whose receipt is the batch's are the ones it stored. No
//! partial indexes: the worker's index is on `(consumer, state, next_attempt_at)`.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, MySql, Pool};

use sqlx::Row as _;
use sqlx::mysql::MySqlConnection;
use sqlx::{Connection, Transaction};

use super::{
    Claimed, ClaimedMany, Expired, InboxBackend, InboxMessage, InboxOperatorBackend, MAX_BATCH,
    Owner, Row, STOPPED, StatsRow,
};

use crate::dialect::mysql::{Arg, READ_COMMITTED, placeholders, update_found, update_found_in};
use crate::dialect::mysql::{ER_DUP_ENTRY, error_number};
use crate::table::Table;

/// What a batch may weigh, all its rows' bytes together, before its insert reads the
/// server's `max_allowed_packet` to split it: far under any server's.
const SMALL_BATCH: usize = 1 << 20;

/// What a statement keeps free of `max_allowed_packet` for its text and its parameters'
/// framing.
const PACKET_SLACK: usize = 64 << 10;

/// The bytes a row adds to the batch insert: its values, and a little for their framing.
fn row_bytes(row: &Row<'_>) -> usize {
    row.id.len()
        + row.payload.len()
        + row.headers.map_or(0, <[u8]>::len)
        + row.ordering_key.map_or(0, str::len)
        + 32 // the fingerprint
        + 2 * 255 // the consumer (bound once per row) and the receipt, at most
        + 64
}

/// The ids of `rows` the inbox holds already, read without locks (at most
/// [`super::MAX_BATCH`] ids: one `IN` list).
async fn present_ids(
    conn: &mut MySqlConnection,
    table: &Table,
    consumer: &str,
    rows: &[Row<'_>],
) -> Result<HashSet<String>, sqlx::Error> {
    let sql = format!(
        "SELECT CAST(message_id AS CHAR) FROM {} WHERE consumer = ? AND message_id IN ({})",
        table.name(),
        placeholders(rows.len())
    );
    let mut select = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql)).bind(consumer);
    for row in rows {
        select = select.bind(row.id);
    }
    Ok(select.fetch_all(&mut *conn).await?.into_iter().collect())
}

/// Inserts `rows` in one statement with a new receipt, then reads which of them carry it:
/// those it stored.
async fn insert_group(
    conn: &mut MySqlConnection,
    table: &Table,
    consumer: &str,
    rows: &[Row<'_>],
) -> Result<Vec<bool>, sqlx::Error> {
    let receipt = crate::random::new_token();
    let mut sql = format!(
        "INSERT INTO {} (consumer, message_id, payload, headers, ordering_key, receipt, \
         fingerprint) VALUES ",
        table.name()
    );
    for index in 0..rows.len() {
        if index > 0 {
            sql.push_str(", ");
        }
        sql.push_str("(?, ?, ?, ?, ?, ?, ?)");
    }
    // A no-op update: the existing row stays as it was, receipt included.
    sql.push_str(" ON DUPLICATE KEY UPDATE consumer = consumer");
    let mut insert = sqlx::query(AssertSqlSafe(sql));
    for row in rows {
        insert = insert
            .bind(consumer)
            .bind(row.id)
            .bind(row.payload)
            .bind(row.headers)
            .bind(row.ordering_key)
            .bind(&receipt[..])
            .bind(row.fingerprint());
    }
    let check = format!(
        "SELECT CAST(message_id AS CHAR) FROM {} WHERE consumer = ? AND receipt = ? \
         AND message_id IN ({})",
        table.name(),
        placeholders(rows.len())
    );
    let mut select = sqlx::query_scalar::<_, String>(AssertSqlSafe(check))
        .bind(consumer)
        .bind(&receipt[..]);
    for row in rows {
        select = select.bind(row.id);
    }
    insert.execute(&mut *conn).await?;
    let stored: HashSet<String> = select.fetch_all(&mut *conn).await?.into_iter().collect();
    Ok(rows.iter().map(|row| stored.contains(row.id)).collect())
}

/// The columns of a claimed message, as [`message`] reads them.
const MESSAGE: &str = "CAST(message_id AS CHAR), payload, headers, attempts, \
                       CAST(ordering_key AS CHAR)";

/// A claimed message from the columns of [`MESSAGE`].
fn message(row: sqlx::mysql::MySqlRow) -> Result<InboxMessage, sqlx::Error> {
    Ok(InboxMessage {
        id: row.try_get(0)?,
        payload: row.try_get::<Option<Vec<u8>>, _>(1)?.unwrap_or_default(),
        headers: row.try_get(2)?,
        ordering_key: row.try_get(4)?,
        attempt: row.try_get::<i32, _>(3)?.max(0) as u32,
    })
}

/// Whether some claim's lease has ended: a look along the lease index, which stops at the
/// first such row (an index scan, which marks the dead entries it passes).
async fn expired_any(
    conn: &mut MySqlConnection,
    table: &Table,
    consumer: &str,
) -> Result<bool, sqlx::Error> {
    let any = format!(
        "SELECT 1 FROM {} WHERE consumer = ? AND state = 1 AND lease_until <= UTC_TIMESTAMP(6) ORDER BY lease_until LIMIT 1",
        table.name()
    );
    Ok(sqlx::query(AssertSqlSafe(any))
        .bind(consumer)
        .fetch_optional(conn)
        .await?
        .is_some())
}

/// The processing transaction: out of autocommit, and the savepoint that the commit
/// releases first (`ClaimBackend::commit_owned`), in the round trip of its `BEGIN` — the
/// handler's own transaction's `BEGIN`. InnoDB ends a transaction by itself on a
/// deadlock, and a handler that swallowed the error goes on in a new one: the savepoint
/// is gone with the old one, its release fails, and nothing of the new one (the mark
/// included) is committed.
async fn begin(conn: &mut MySqlConnection) -> Result<Transaction<'_, MySql>, sqlx::Error> {
    conn.begin_with(crate::claim::mysql::BEGIN).await
}

impl InboxBackend for MySql {
    fn inbox_ddl(table: &Table) -> Vec<String> {
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {name} (\n    \
             seq             BIGINT NOT NULL AUTO_INCREMENT,\n    \
             consumer        VARBINARY(255) NOT NULL,\n    \
             message_id      VARBINARY(255) NOT NULL,\n    \
             payload         LONGBLOB NULL,\n    \
             headers         MEDIUMBLOB NULL,\n    \
             ordering_key    VARBINARY(255) NULL,\n    \
             received_at     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             state           TINYINT NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
             attempts        INT NOT NULL DEFAULT 0,\n    \
             next_attempt_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             owner           BINARY(16) NULL,\n    \
             lease_until     DATETIME(6) NULL,\n    \
             last_error      TEXT NULL,\n    \
             processed_at    DATETIME(6) NULL,\n    \
             receipt         BINARY(16) NULL,\n    \
             fingerprint     BINARY(32) NULL,\n    \
             PRIMARY KEY (consumer, message_id),\n    \
             UNIQUE KEY seq_key (seq),\n    \
             KEY work_idx (consumer, state, next_attempt_at),\n    \
             KEY ordering_idx (consumer, ordering_key, seq),\n    \
             KEY processed_idx (state, processed_at)\n\
             ) ENGINE = InnoDB",
            name = table.name()
        )]
    }

    async fn inbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::mysql::create_locked(pool, Self::inbox_ddl(table)).await?;
        crate::schema::mysql::widen_headers(pool, table).await?;
        // A table made before the payloads' fingerprints were stored.
        crate::schema::mysql::add_missing(pool, table, "fingerprint", "BINARY(32) NULL").await
    }

    async fn inbox_fingerprints<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        ids: &'a [&'a str],
    ) -> Result<Vec<super::StoredFingerprint>, sqlx::Error> {
        let sql = format!(
            "SELECT CAST(message_id AS CHAR), fingerprint FROM {} \
             WHERE consumer = ? AND message_id IN ({})",
            table.name(),
            placeholders(ids.len())
        );
        let mut query = sqlx::query_as(AssertSqlSafe(sql)).bind(consumer);
        for id in ids {
            query = query.bind(*id);
        }
        query.fetch_all(pool).await
    }

    async fn inbox_insert<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        rows: &'a [Row<'a>],
    ) -> Result<Vec<bool>, sqlx::Error> {
        if let [row] = rows {
            // One row: a plain insert, whose duplicate-key error (1062: only the primary
            // key can raise it here) is the duplicate.
            let sql = format!(
                "INSERT INTO {} (consumer, message_id, payload, headers, ordering_key, \
                 fingerprint) VALUES (?, ?, ?, ?, ?, ?)",
                table.name()
            );
            let result = sqlx::query(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(row.id)
                .bind(row.payload)
                .bind(row.headers)
                .bind(row.ordering_key)
                .bind(row.fingerprint())
                .execute(pool)
                .await;
            return match result {
                Ok(_) => Ok(vec![true]),
                Err(error) if error_number(&error) == Some(ER_DUP_ENTRY) => Ok(vec![false]),
                Err(error) => Err(error),
            };
        }
        let mut conn = pool.acquire().await?;
        // One statement must fit the server's `max_allowed_packet` (16 MiB by default on
        // MariaDB): a batch of large messages goes in groups under it. Read only when the
        // batch is large enough to matter.
        let bytes: usize = rows.iter().map(row_bytes).sum();
        let budget = if bytes <= SMALL_BATCH {
            usize::MAX
        } else {
            let packet: u64 = sqlx::query_scalar("SELECT @@max_allowed_packet")
                .fetch_one(&mut *conn)
                .await?;
            usize::try_from(packet)
                .unwrap_or(usize::MAX)
                .saturating_sub(PACKET_SLACK)
                .max(1)
        };
        // The ids already stored (a plain read, no locks) are duplicates and stay out of
        // the insert: a duplicate costs the insert a lock on the existing row, and
        // batches at the same moment that meet the same stored ids in other orders would
        // deadlock on them. Ids stored by another caller meanwhile are still told apart
        // by the receipt.
        let present = present_ids(&mut conn, table, consumer, rows).await?;
        let fresh: Vec<Row<'_>> = rows
            .iter()
            .filter(|row| !present.contains(row.id))
            .copied()
            .collect();
        let mut stored_fresh = Vec::with_capacity(fresh.len());
        let mut rest = &fresh[..];
        while !rest.is_empty() {
            // At least one row per statement; as many more as fit the budget.
            let mut take = 1;
            let mut size = row_bytes(&rest[0]);
            while take < rest.len() && size + row_bytes(&rest[take]) <= budget {
                size += row_bytes(&rest[take]);
                take += 1;
            }
            let (group, after) = rest.split_at(take);
            stored_fresh.extend(insert_group(&mut conn, table, consumer, group).await?);
            rest = after;
        }
        let mut stored_fresh = stored_fresh.into_iter();
        Ok(rows
            .iter()
            .map(|row| !present.contains(row.id) && stored_fresh.next().unwrap_or(false))
            .collect())
    }

    async fn inbox_expired<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
    ) -> Result<Vec<Expired>, sqlx::Error> {
        let sql = format!(
            "SELECT owner, CAST(message_id AS CHAR), attempts FROM {name} WHERE consumer = ? \
             AND state = 1 AND owner IN (SELECT owner FROM {name} WHERE consumer = ? \
             AND state = 1 AND lease_until <= UTC_TIMESTAMP(6)) \
             ORDER BY owner, next_attempt_at, seq LIMIT ?",
            name = table.name()
        );
        let rows: Vec<(Vec<u8>, String, i32)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(consumer)
            .bind(MAX_BATCH as u32)
            .fetch_all(pool)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(owner, id, attempts)| {
                Some(Expired {
                    owner: owner.try_into().ok()?,
                    id,
                    attempts: attempts.max(0) as u32,
                })
            })
            .collect())
    }

    /// In one READ COMMITTED transaction, every row by primary key: the first row by its
    /// id, the others through `update_found_in`.
    async fn inbox_reclaim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        first: &'a str,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let name = table.name();
        let fence = "consumer = ? AND owner = ? AND state = 1";
        let first_sql = if dead {
            format!(
                "UPDATE {name} SET state = 3, owner = NULL, lease_until = NULL, \
                 last_error = CONCAT('attempt ', attempts, ?) WHERE {fence} AND message_id = ?"
            )
        } else {
            format!(
                "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL \
                 WHERE {fence} AND message_id = ?"
            )
        };
        let mut tx = pool.begin_with(READ_COMMITTED).await?;
        let mut first_query = sqlx::query(AssertSqlSafe(first_sql));
        if dead {
            first_query = first_query.bind(STOPPED);
        }
        let taken = first_query
            .bind(consumer)
            .bind(&owner[..])
            .bind(first)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
        update_found_in(
            &mut tx,
            name,
            "message_id",
            (
                "state = 0, owner = NULL, lease_until = NULL, attempts = attempts - 1",
                &[],
            ),
            (fence, &[Arg::Text(consumer), Arg::Bytes(&owner[..])]),
        )
        .await?;
        tx.commit().await?;
        Ok(taken)
    }

    async fn inbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
    ) -> Result<Vec<InboxMessage>, sqlx::Error> {
        let sql = format!(
            "SELECT {MESSAGE} FROM {} WHERE consumer = ? AND owner = ? AND state = 1 \
             ORDER BY next_attempt_at, seq",
            table.name()
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(&owner[..])
            .fetch_all(pool)
            .await?;
        rows.into_iter().map(message).collect()
    }

    /// `SELECT … FOR UPDATE SKIP LOCKED` (MariaDB 10.6, MySQL 8), then one `UPDATE` of the
    /// ids it locked, in one transaction: MySQL has no `UPDATE … RETURNING`.
    async fn inbox_claim<'a>(
        conn: &'a mut MySqlConnection,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
        limit: u32,
    ) -> Result<(Vec<InboxMessage>, bool), sqlx::Error> {
        let expired = expired_any(&mut *conn, table, consumer).await?;
        let name = table.name();
        // READ COMMITTED: no gap locks, so that workers claiming at once skip each other's
        // rows instead of deadlocking on the index ranges they scan.
        let mut tx = conn.begin_with(READ_COMMITTED).await?;
        let pending = format!(
            "SELECT CAST(message_id AS CHAR) FROM {name} AS m WHERE consumer = ? AND state = 0 \
             AND next_attempt_at <= UTC_TIMESTAMP(6) \
             AND (m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {name} AS e \
             WHERE e.consumer = m.consumer AND e.ordering_key = m.ordering_key \
             AND e.seq < m.seq AND e.state <> 2)) \
             ORDER BY next_attempt_at, seq LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        let ids: Vec<String> = sqlx::query_scalar(AssertSqlSafe(pending))
            .bind(consumer)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        if ids.is_empty() {
            tx.rollback().await?;
            return Ok((Vec::new(), expired));
        }
        let update = format!(
            "UPDATE {name} SET state = 1, owner = ?, attempts = attempts + 1, \
             lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE consumer = ? AND message_id IN ({})",
            placeholders(ids.len())
        );
        let mut query = sqlx::query(AssertSqlSafe(update))
            .bind(&owner[..])
            .bind(lease_us)
            .bind(consumer);
        for id in &ids {
            query = query.bind(id);
        }
        query.execute(&mut *tx).await?;
        let select = format!(
            "SELECT {MESSAGE} FROM {name} WHERE consumer = ? AND message_id IN ({})",
            placeholders(ids.len())
        );
        let mut query = sqlx::query(AssertSqlSafe(select)).bind(consumer);
        for id in &ids {
            query = query.bind(id);
        }
        let rows = query.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        let mut messages = rows
            .into_iter()
            .map(message)
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        // In the claim's order, not the key's.
        messages.sort_by_key(|message| ids.iter().position(|id| *id == message.id));
        Ok((messages, expired))
    }

    /// The worker's `BEGIN` (the session out of autocommit) and a savepoint, in one round
    /// trip. InnoDB ends a transaction by itself on a deadlock, and a handler that
    /// swallowed the error goes on in a new one: the savepoint is gone with the old one,
    /// and the commit, which releases it first, tells.
    async fn inbox_begin<'c>(
        conn: &'c mut MySqlConnection,
        _: &'c Claimed<'c>,
    ) -> Result<(Transaction<'c, Self>, bool), sqlx::Error> {
        Ok((begin(conn).await?, true))
    }

    /// The owner-checked mark. (Whether the transaction is still the one `inbox_begin`
    /// began, the commit tells: it releases the savepoint first,
    /// [`RolledBack`](crate::RolledBack) if it is gone, in the commit's round trip.)
    async fn inbox_finish<'c>(
        conn: &'c mut MySqlConnection,
        row: &'c Claimed<'c>,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET state = 2, processed_at = UTC_TIMESTAMP(6), lease_until = NULL{} \
             WHERE consumer = ? AND message_id = ? AND owner = ? AND state = 1",
            row.table.name(),
            super::payload_dropped(row.drop_payload)
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(row.consumer)
            .bind(row.id)
            .bind(&row.owner[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// As [`inbox_begin`](InboxBackend::inbox_begin): no check, no lock.
    async fn inbox_begin_many<'c>(
        conn: &'c mut MySqlConnection,
        _: &'c ClaimedMany<'c>,
    ) -> Result<(Transaction<'c, Self>, Option<Vec<String>>), sqlx::Error> {
        Ok((begin(conn).await?, None))
    }

    /// The owner-checked mark of every id, by primary key (the commit releases the
    /// savepoint, as after [`inbox_finish`](InboxBackend::inbox_finish)).
    async fn inbox_finish_many<'c>(
        conn: &'c mut MySqlConnection,
        rows: &'c ClaimedMany<'c>,
    ) -> Result<u64, sqlx::Error> {
        if rows.ids.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "UPDATE {} SET state = 2, processed_at = UTC_TIMESTAMP(6), lease_until = NULL{} \
             WHERE consumer = ? AND message_id IN ({}) AND owner = ? AND state = 1",
            rows.table.name(),
            super::payload_dropped(rows.drop_payload),
            placeholders(rows.ids.len())
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(rows.consumer);
        for id in rows.ids {
            query = query.bind(*id);
        }
        let done = query.bind(&rows.owner[..]).execute(conn).await?;
        Ok(done.rows_affected())
    }

    async fn inbox_renew<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
    ) -> Result<u64, sqlx::Error> {
        // By primary key, as the bury: the rows of other workers' marks are not touched.
        update_found(
            pool,
            table.name(),
            "message_id",
            (
                "lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND",
                &[Arg::I64(lease_us)],
            ),
            (
                "consumer = ? AND state = 1 AND owner = ?",
                &[Arg::Text(consumer), Arg::Bytes(&owner[..])],
            ),
        )
        .await
    }

    async fn inbox_fail<'a>(
        pool: &'a Pool<Self>,
        row: &'a Claimed<'a>,
        error: &'a str,
        delay_us: i64,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET state = ?, owner = NULL, lease_until = NULL, last_error = ?, \
             next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE consumer = ? AND message_id = ? AND owner = ? AND state = 1",
            row.table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(if dead { 3_i8 } else { 0 })
            .bind(error)
            .bind(delay_us)
            .bind(row.consumer)
            .bind(row.id)
            .bind(&row.owner[..])
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn inbox_release<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        except: &'a str,
    ) -> Result<u64, sqlx::Error> {
        update_found(
            pool,
            table.name(),
            "message_id",
            (
                "state = 0, owner = NULL, lease_until = NULL, attempts = attempts - 1",
                &[],
            ),
            (
                "consumer = ? AND state = 1 AND owner = ? AND message_id <> ?",
                &[
                    Arg::Text(consumer),
                    Arg::Bytes(&owner[..]),
                    Arg::Text(except),
                ],
            ),
        )
        .await
    }
}

impl InboxOperatorBackend for MySql {
    async fn inbox_dead<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> Result<Vec<(String, i64, Option<String>)>, sqlx::Error> {
        let sql = format!(
            "SELECT CAST(message_id AS CHAR), CAST(attempts AS SIGNED), last_error FROM {} WHERE consumer = ? AND state = 3 ORDER BY seq LIMIT ?",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(limit)
            .fetch_all(pool)
            .await
    }

    async fn inbox_resolve<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
        requeue: bool,
    ) -> Result<bool, sqlx::Error> {
        // The operator's one list of what a requeue or a discard sets.
        let set = <Self as crate::operate::OperateBackend>::operate_set(
            crate::operate::Queue::Inbox,
            requeue,
        );
        let sql = format!(
            "UPDATE {} SET {set} WHERE consumer = ? AND message_id = ? AND state = 3",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(id)
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn inbox_prune<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        age_us: i64,
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let name = table.name();
        let sql = format!(
            "DELETE FROM {name} WHERE consumer = ? AND state = 2 AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND ORDER BY processed_at LIMIT ?"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(age_us)
            .bind(batch)
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn inbox_backlog<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> Result<i64, sqlx::Error> {
        let sql = format!(
            "SELECT COUNT(*) FROM (SELECT 1 FROM {} WHERE consumer = ? AND state IN (0, 1) LIMIT ?) AS backlog",
            table.name()
        );
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(limit)
            .fetch_one(pool)
            .await
    }

    async fn inbox_stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
    ) -> Result<StatsRow, sqlx::Error> {
        let sql = format!(
            "SELECT CAST(COALESCE(SUM(state = 0), 0) AS SIGNED), CAST(COALESCE(SUM(state = 1), 0) AS SIGNED), CAST(COALESCE(SUM(state = 2), 0) AS SIGNED), CAST(COALESCE(SUM(state = 3), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN state = 0 THEN received_at END), UTC_TIMESTAMP(6)) AS SIGNED) FROM {} WHERE consumer = ?",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .fetch_one(pool)
            .await
    }
}
