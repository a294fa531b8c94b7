//! SQLite: payloads as `BLOB`, times as `processed_at`'s ISO 8601 text in UTC, partial
//! indexes for the rows a worker looks for, and a multi-row `INSERT … RETURNING`.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use sqlx::Row as _;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Connection, Transaction};

use super::{
    Claimed, ClaimedMany, Expired, InboxBackend, InboxMessage, InboxOperatorBackend, MAX_BATCH,
    Owner, Row, STOPPED, StatsRow,
};
use crate::dialect::sqlite::BEGIN;
use crate::dialect::sqlite::{NOW, index_name, later};
use crate::table::Table;

/// `owner`'s (`?2`) claimed rows get a lease of `?3` microseconds from now.
fn renew_sql(table: &Table) -> String {
    format!(
        "UPDATE {} SET lease_until = {} WHERE consumer = ?1 AND owner = ?2 AND state = 1",
        table.name(),
        later("?3")
    )
}

/// The columns of a claimed message, as [`message`] reads them.
const MESSAGE: &str = "message_id, payload, headers, attempts, ordering_key";

/// A claimed message from the columns of [`MESSAGE`].
fn message(row: sqlx::sqlite::SqliteRow) -> Result<InboxMessage, sqlx::Error> {
    Ok(InboxMessage {
        id: row.try_get(0)?,
        payload: row.try_get::<Option<Vec<u8>>, _>(1)?.unwrap_or_default(),
        headers: row.try_get(2)?,
        ordering_key: row.try_get(4)?,
        attempt: row.try_get::<i64, _>(3)?.clamp(0, i64::from(u32::MAX)) as u32,
    })
}

/// Whether some claim's lease has ended: a look along the lease index, which stops at the
/// first such row (an index scan, which marks the dead entries it passes).
async fn expired_any(
    conn: &mut SqliteConnection,
    table: &Table,
    consumer: &str,
) -> Result<bool, sqlx::Error> {
    let any = format!(
        "SELECT 1 FROM {} WHERE consumer = ?1 AND state = 1 AND lease_until <= {NOW} ORDER BY lease_until LIMIT 1",
        table.name()
    );
    Ok(sqlx::query(AssertSqlSafe(any))
        .bind(consumer)
        .fetch_optional(conn)
        .await?
        .is_some())
}

impl InboxBackend for Sqlite {
    fn inbox_ddl(table: &Table) -> Vec<String> {
        let (name, base) = (table.name(), table.base());
        vec![
            // `seq` is the rowid: receive order.
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 seq             INTEGER PRIMARY KEY,\n    \
                 consumer        TEXT NOT NULL,\n    \
                 message_id      TEXT NOT NULL,\n    \
                 payload         BLOB,\n    \
                 headers         BLOB,\n    \
                 ordering_key    TEXT,\n    \
                 received_at     TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 state           INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        INTEGER NOT NULL DEFAULT 0,\n    \
                 next_attempt_at TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 owner           BLOB,\n    \
                 lease_until     TEXT,\n    \
                 last_error      TEXT,\n    \
                 processed_at    TEXT,\n    \
                 fingerprint     BLOB,\n    \
                 UNIQUE (consumer, message_id)\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (consumer, next_attempt_at, seq) \
                 WHERE state = 0",
                index_name(table, "pending_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (consumer, ordering_key, seq) \
                 WHERE ordering_key IS NOT NULL AND state <> 2",
                index_name(table, "ordering_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (consumer, lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (processed_at) WHERE state = 2",
                index_name(table, "processed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (consumer, seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
        ]
    }

    async fn inbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::sqlite::create_locked(pool, Self::inbox_ddl(table)).await?;
        // A table made before the payloads' fingerprints were stored.
        crate::schema::sqlite::add_missing(pool, table, "fingerprint", "BLOB").await
    }

    async fn inbox_fingerprints<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        ids: &'a [&'a str],
    ) -> Result<Vec<super::StoredFingerprint>, sqlx::Error> {
        let list: Vec<String> = (0..ids.len()).map(|n| format!("?{}", n + 2)).collect();
        let sql = format!(
            "SELECT message_id, fingerprint FROM {} WHERE consumer = ?1 AND message_id IN ({})",
            table.name(),
            list.join(", ")
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
        let mut sql = format!(
            "INSERT INTO {} (consumer, message_id, payload, headers, ordering_key, fingerprint) \
             VALUES ",
            table.name()
        );
        // Numbered parameters only: sqlx counts anonymous ones on their own, from 1.
        for index in 0..rows.len() {
            if index > 0 {
                sql.push_str(", ");
            }
            let first = 2 + 5 * index;
            sql.push_str(&format!(
                "(?1, ?{first}, ?{}, ?{}, ?{}, ?{})",
                first + 1,
                first + 2,
                first + 3,
                first + 4
            ));
        }
        sql.push_str(" ON CONFLICT DO NOTHING RETURNING message_id");
        let mut query = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql)).bind(consumer);
        for row in rows {
            query = query
                .bind(row.id)
                .bind(row.payload)
                .bind(row.headers)
                .bind(row.ordering_key)
                .bind(row.fingerprint());
        }
        let stored: HashSet<String> = query.fetch_all(pool).await?.into_iter().collect();
        Ok(rows.iter().map(|row| stored.contains(row.id)).collect())
    }

    async fn inbox_expired<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
    ) -> Result<Vec<Expired>, sqlx::Error> {
        let sql = format!(
            "SELECT owner, message_id, attempts FROM {name} WHERE consumer = ?1 AND state = 1 \
             AND owner IN (SELECT owner FROM {name} WHERE consumer = ?1 AND state = 1 \
             AND lease_until <= {NOW}) ORDER BY owner, next_attempt_at, seq LIMIT ?2",
            name = table.name()
        );
        let rows: Vec<(Vec<u8>, String, i64)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(MAX_BATCH as i64)
            .fetch_all(pool)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(owner, id, attempts)| {
                Some(Expired {
                    owner: owner.try_into().ok()?,
                    id,
                    attempts: attempts.clamp(0, i64::from(u32::MAX)) as u32,
                })
            })
            .collect())
    }

    /// Both statements in one transaction: under SQLite's single writer, nothing comes
    /// between them.
    async fn inbox_reclaim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        first: &'a str,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let name = table.name();
        let fence = "consumer = ?1 AND owner = ?2 AND state = 1";
        let first_sql = if dead {
            format!(
                "UPDATE {name} SET state = 3, owner = NULL, lease_until = NULL, \
                 last_error = 'attempt ' || attempts || ?4 WHERE {fence} AND message_id = ?3"
            )
        } else {
            format!(
                "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL \
                 WHERE {fence} AND message_id = ?3"
            )
        };
        let mut tx = pool.begin_with(BEGIN).await?;
        let mut first_query = sqlx::query(AssertSqlSafe(first_sql))
            .bind(consumer)
            .bind(&owner[..])
            .bind(first);
        if dead {
            first_query = first_query.bind(STOPPED);
        }
        let taken = first_query.execute(&mut *tx).await?.rows_affected() == 1;
        let rest = format!(
            "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL, \
             attempts = attempts - 1 WHERE {fence}"
        );
        sqlx::query(AssertSqlSafe(rest))
            .bind(consumer)
            .bind(&owner[..])
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(taken)
    }

    async fn inbox_claim<'a>(
        conn: &'a mut SqliteConnection,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
        limit: u32,
    ) -> Result<(Vec<InboxMessage>, bool), sqlx::Error> {
        let expired = expired_any(&mut *conn, table, consumer).await?;
        let name = table.name();
        // One statement, atomic under SQLite's single writer.
        let pending = format!(
            "UPDATE {name} SET state = 1, owner = ?2, attempts = attempts + 1, lease_until = {} \
             WHERE seq IN (SELECT seq FROM {name} AS m WHERE consumer = ?1 \
             AND state = 0 AND next_attempt_at <= {NOW} \
             AND (m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {name} AS e \
             WHERE e.consumer = m.consumer AND e.ordering_key = m.ordering_key \
             AND e.seq < m.seq AND e.state <> 2)) \
             ORDER BY next_attempt_at, seq LIMIT ?4) RETURNING {MESSAGE}, next_attempt_at, seq",
            later("?3")
        );
        let mut rows = sqlx::query(AssertSqlSafe(pending))
            .bind(consumer)
            .bind(&owner[..])
            .bind(lease_us)
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        // `RETURNING` returns its rows in no particular order: sorted again, in the claim's
        // order (due time, then receive order). The times are ISO 8601 text in UTC of one
        // width: they sort as text.
        rows.sort_by_cached_key(|row| {
            (
                row.try_get::<String, _>(5).unwrap_or_default(),
                row.try_get::<i64, _>(6).unwrap_or(i64::MAX),
            )
        });
        let messages = rows
            .into_iter()
            .map(message)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((messages, expired))
    }

    async fn inbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
    ) -> Result<Vec<InboxMessage>, sqlx::Error> {
        let sql = format!(
            "SELECT {MESSAGE} FROM {} WHERE consumer = ?1 AND owner = ?2 AND state = 1 \
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

    /// `BEGIN IMMEDIATE`, then the mark itself, owner-checked: the transaction holds
    /// SQLite's only write lock from its start, so no other worker can take the row
    /// meanwhile, and a transaction SQLite rolled back by itself fails its `COMMIT`.
    async fn inbox_begin<'c>(
        conn: &'c mut SqliteConnection,
        row: &'c Claimed<'c>,
    ) -> Result<(Transaction<'c, Self>, bool), sqlx::Error> {
        let mut tx = conn.begin_with(BEGIN).await?;
        let sql = format!(
            "UPDATE {} SET state = 2, processed_at = {NOW}, lease_until = NULL{} \
             WHERE consumer = ?1 AND message_id = ?2 AND owner = ?3 AND state = 1",
            row.table.name(),
            super::payload_dropped(row.drop_payload)
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(row.consumer)
            .bind(row.id)
            .bind(&row.owner[..])
            .execute(&mut *tx)
            .await?;
        Ok((tx, done.rows_affected() == 1))
    }

    /// Marked at the start; renews the claim's other rows when the last renewal is a
    /// heartbeat old ([`Claimed::renew`]): the heartbeat cannot write while this
    /// transaction holds the write lock, and they must not be taken over between two of
    /// the worker's transactions.
    async fn inbox_finish<'c>(
        conn: &'c mut SqliteConnection,
        row: &'c Claimed<'c>,
    ) -> Result<bool, sqlx::Error> {
        if let Some(lease_us) = row.renew {
            sqlx::query(AssertSqlSafe(renew_sql(row.table)))
                .bind(row.consumer)
                .bind(&row.owner[..])
                .bind(lease_us)
                .execute(conn)
                .await?;
        }
        Ok(true)
    }

    /// `BEGIN IMMEDIATE`, then the rows still `rows.owner`'s marked processed (this
    /// transaction holds the write lock: no other worker can take them before it ends);
    /// the ids marked, for the handler.
    async fn inbox_begin_many<'c>(
        conn: &'c mut SqliteConnection,
        rows: &'c ClaimedMany<'c>,
    ) -> Result<(Transaction<'c, Self>, Option<Vec<String>>), sqlx::Error> {
        let mut tx = conn.begin_with(BEGIN).await?;
        if rows.ids.is_empty() {
            return Ok((tx, Some(Vec::new())));
        }
        let list = (0..rows.ids.len())
            .map(|index| format!("?{}", index + 3))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "UPDATE {} SET state = 2, processed_at = {NOW}, lease_until = NULL{} \
             WHERE consumer = ?1 AND owner = ?2 AND state = 1 AND message_id IN ({list}) \
             RETURNING message_id",
            rows.table.name(),
            super::payload_dropped(rows.drop_payload)
        );
        let mut query = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(rows.consumer)
            .bind(&rows.owner[..]);
        for id in rows.ids {
            query = query.bind(*id);
        }
        let marked: Vec<String> = query.fetch_all(&mut *tx).await?;
        Ok((tx, Some(marked)))
    }

    /// Marked at the start; renews the claim's other rows as
    /// [`inbox_finish`](InboxBackend::inbox_finish) does.
    async fn inbox_finish_many<'c>(
        conn: &'c mut SqliteConnection,
        rows: &'c ClaimedMany<'c>,
    ) -> Result<u64, sqlx::Error> {
        if let Some(lease_us) = rows.renew {
            sqlx::query(AssertSqlSafe(renew_sql(rows.table)))
                .bind(rows.consumer)
                .bind(&rows.owner[..])
                .bind(lease_us)
                .execute(conn)
                .await?;
        }
        Ok(rows.ids.len() as u64)
    }

    async fn inbox_renew<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
    ) -> Result<u64, sqlx::Error> {
        let sql = renew_sql(table);
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(&owner[..])
            .bind(lease_us)
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn inbox_fail<'a>(
        pool: &'a Pool<Self>,
        row: &'a Claimed<'a>,
        error: &'a str,
        delay_us: i64,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET state = ?4, owner = NULL, lease_until = NULL, last_error = ?5, \
             next_attempt_at = {} \
             WHERE consumer = ?1 AND message_id = ?2 AND owner = ?3 AND state = 1",
            row.table.name(),
            later("?6")
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(row.consumer)
            .bind(row.id)
            .bind(&row.owner[..])
            .bind(if dead { 3_i64 } else { 0 })
            .bind(error)
            .bind(delay_us)
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
        let sql = format!(
            "UPDATE {} SET state = 0, owner = NULL, lease_until = NULL, attempts = attempts - 1 \
             WHERE consumer = ?1 AND owner = ?2 AND state = 1 AND message_id <> ?3",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(&owner[..])
            .bind(except)
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }
}

impl InboxOperatorBackend for Sqlite {
    async fn inbox_dead<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> Result<Vec<(String, i64, Option<String>)>, sqlx::Error> {
        let sql = format!(
            "SELECT message_id, attempts, last_error FROM {} WHERE consumer = ?1 AND state = 3 ORDER BY seq LIMIT ?2",
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
            "UPDATE {} SET {set} WHERE consumer = ?1 AND message_id = ?2 AND state = 3",
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
            "DELETE FROM {name} WHERE seq IN (SELECT seq FROM {name} WHERE consumer = ?1 AND state = 2 AND processed_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%.6f seconds', ?2 / 1000000.0)) LIMIT ?3)"
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
            "SELECT COUNT(*) FROM (SELECT 1 FROM {} WHERE consumer = ?1 AND state IN (0, 1) LIMIT ?2)",
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
            "SELECT COALESCE(SUM(state = 0), 0), COALESCE(SUM(state = 1), 0), COALESCE(SUM(state = 2), 0), COALESCE(SUM(state = 3), 0), CAST((julianday('now') - julianday(MIN(CASE WHEN state = 0 THEN received_at END))) * 86400000000.0 AS INTEGER) FROM {} WHERE consumer = ?1",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .fetch_one(pool)
            .await
    }
}
