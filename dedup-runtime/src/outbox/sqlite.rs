//! SQLite: `BLOB` ids (the UUID's 16 bytes), times as UTC text on the database's clock.

use sqlx::sqlite::SqliteConnection;
use sqlx::{AssertSqlSafe, Pool, Sqlite};

use sqlx::Row as _;

use super::{
    DeadOutgoing, ExpiredOutgoing, Inserted, OutboxBackend, OutboxMessage, OutgoingId, Row,
    STOPPED, StatsRow, relay_table,
};
use crate::dialect::sqlite::{NOW, index_name, later};
use crate::random::Owner;
use crate::table::Table;

/// The columns of a claimed row, as [`message`] reads them.
const MESSAGE: &str = "id, destination, payload, headers, ordering_key, attempts, seq, traceparent";

/// A claimed row from the columns of [`MESSAGE`].
fn message(row: sqlx::sqlite::SqliteRow) -> Result<OutboxMessage, sqlx::Error> {
    Ok(OutboxMessage {
        id: OutgoingId::decode_bytes(&row.try_get::<Vec<u8>, _>(0)?)?,
        destination: row.try_get(1)?,
        payload: row.try_get(2)?,
        headers: row.try_get(3)?,
        ordering_key: row.try_get(4)?,
        attempt: row.try_get::<i64, _>(5)?.max(0) as u32,
        seq: row.try_get(6)?,
        traceparent: row.try_get(7)?,
    })
}

impl OutboxBackend for Sqlite {
    fn outbox_ddl(table: &Table) -> Vec<String> {
        let (name, base) = (table.name(), table.base());
        vec![
            // `seq` is the rowid: enqueue order.
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 seq             INTEGER PRIMARY KEY,\n    \
                 id              BLOB NOT NULL UNIQUE CHECK (length(id) = 16),\n    \
                 consumer        TEXT NOT NULL,\n    \
                 cause_id        TEXT NOT NULL,\n    \
                 slot            TEXT NOT NULL,\n    \
                 destination     TEXT NOT NULL,\n    \
                 payload         BLOB NOT NULL,\n    \
                 headers         BLOB,\n    \
                 ordering_key    TEXT,\n    \
                 traceparent     TEXT,\n    \
                 created_at      TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 state           INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        INTEGER NOT NULL DEFAULT 0,\n    \
                 next_attempt_at TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 owner           BLOB,\n    \
                 lease_until     TEXT,\n    \
                 last_error      TEXT,\n    \
                 sent_at         TEXT\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (next_attempt_at, seq) WHERE state = 0",
                index_name(table, "unsent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (ordering_key, seq) \
                 WHERE ordering_key IS NOT NULL AND state <> 2",
                index_name(table, "ordering_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (sent_at) WHERE state = 2",
                index_name(table, "sent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
            // The relays' sign of life: one row, its time the last batch's.
            format!(
                "CREATE TABLE IF NOT EXISTS {} (\n    \
                 id        INTEGER PRIMARY KEY CHECK (id = 1),\n    \
                 last_seen TEXT NOT NULL\n)",
                relay_table(table)
            ),
        ]
    }

    async fn outbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::sqlite::create_locked(pool, Self::outbox_ddl(table)).await?;
        // A table made before the trace context was stored.
        crate::schema::sqlite::add_missing(pool, table, "traceparent", "TEXT").await
    }

    async fn outbox_insert<'c>(
        conn: &'c mut SqliteConnection,
        table: &'c Table,
        row: &'c Row<'c>,
    ) -> Result<Inserted, sqlx::Error> {
        let name = table.name();
        let id = row.id.as_uuid();
        let insert = format!(
            "INSERT INTO {name} (id, consumer, cause_id, slot, destination, payload, headers, \
             ordering_key, traceparent) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
             ON CONFLICT (id) DO NOTHING"
        );
        let done = sqlx::query(AssertSqlSafe(insert))
            .bind(&id.as_bytes()[..])
            .bind(row.consumer)
            .bind(row.cause_id)
            .bind(row.slot)
            .bind(row.destination)
            .bind(row.payload)
            .bind(row.headers)
            .bind(row.ordering_key)
            .bind(row.traceparent)
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() == 1 {
            return Ok(Inserted::Stored);
        }
        let select = format!("SELECT CAST(destination AS BLOB), payload FROM {name} WHERE id = ?1");
        let (destination, payload): (Vec<u8>, Vec<u8>) = sqlx::query_as(AssertSqlSafe(select))
            .bind(&id.as_bytes()[..])
            .fetch_one(conn)
            .await?;
        Ok(Inserted::Existing {
            destination,
            payload,
        })
    }

    async fn outbox_expired<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> Result<Vec<ExpiredOutgoing>, sqlx::Error> {
        // Most claims find no claim ended: first a look along the lease index, which
        // stops at the first such row (and, an index scan, marks the dead entries it
        // passes, where a bitmap scan of the whole query would read them every time).
        let any = format!(
            "SELECT 1 FROM {} WHERE state = 1 AND lease_until <= {NOW} ORDER BY lease_until LIMIT 1",
            table.name()
        );
        if sqlx::query(AssertSqlSafe(any))
            .fetch_optional(pool)
            .await?
            .is_none()
        {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT owner, id, attempts FROM {name} WHERE state = 1 \
             AND owner IN (SELECT owner FROM {name} WHERE state = 1 AND lease_until <= {NOW}) \
             ORDER BY owner, seq LIMIT 1000",
            name = table.name()
        );
        let rows: Vec<(Vec<u8>, Vec<u8>, i64)> =
            sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?;
        let mut expired = Vec::with_capacity(rows.len());
        for (owner, id, attempts) in rows {
            if let Ok(owner) = owner.try_into() {
                expired.push(ExpiredOutgoing {
                    owner,
                    id: OutgoingId::decode_bytes(&id)?,
                    attempts: attempts.clamp(0, i64::from(u32::MAX)) as u32,
                });
            }
        }
        Ok(expired)
    }

    async fn outbox_reclaim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        first: OutgoingId,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let name = table.name();
        let fence = "owner = ?1 AND state = 1";
        let first_sql = if dead {
            format!(
                "UPDATE {name} SET state = 3, owner = NULL, lease_until = NULL, \
                 last_error = 'attempt ' || attempts || ?3 WHERE {fence} AND id = ?2"
            )
        } else {
            format!(
                "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL \
                 WHERE {fence} AND id = ?2"
            )
        };
        let mut first_query = sqlx::query(AssertSqlSafe(first_sql))
            .bind(&owner[..])
            .bind(&first.as_uuid().as_bytes()[..]);
        if dead {
            first_query = first_query.bind(STOPPED);
        }
        let mut tx = pool.begin_with(crate::dialect::sqlite::BEGIN).await?;
        let taken = first_query.execute(&mut *tx).await?.rows_affected() == 1;
        let rest = format!(
            "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL, \
             attempts = attempts - 1 WHERE {fence}"
        );
        sqlx::query(AssertSqlSafe(rest))
            .bind(&owner[..])
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(taken)
    }

    async fn outbox_claim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        lease_us: i64,
        limit: u32,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        let name = table.name();
        // One statement, atomic under SQLite's single writer.
        let unsent = format!(
            "UPDATE {name} SET state = 1, owner = ?1, attempts = attempts + 1, lease_until = {} \
             WHERE seq IN (SELECT seq FROM {name} AS m WHERE state = 0 \
             AND next_attempt_at <= {NOW} \
             AND (m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {name} AS e \
             WHERE e.ordering_key = m.ordering_key AND e.seq < m.seq AND e.state <> 2)) \
             ORDER BY next_attempt_at, seq LIMIT ?3) RETURNING {MESSAGE}",
            later("?2")
        );
        let mut messages = sqlx::query(AssertSqlSafe(unsent))
            .bind(&owner[..])
            .bind(lease_us)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?
            .into_iter()
            .map(message)
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        messages.sort_by_key(|message| message.seq);
        Ok(messages)
    }

    async fn outbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        let sql = format!(
            "SELECT {MESSAGE} FROM {} WHERE owner = ?1 AND state = 1 ORDER BY seq",
            table.name()
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(&owner[..])
            .fetch_all(pool)
            .await?
            .into_iter()
            .map(message)
            .collect()
    }

    async fn outbox_renew<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        lease_us: i64,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET lease_until = {} WHERE owner = ?1 AND state = 1",
            table.name(),
            later("?2")
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(&owner[..])
            .bind(lease_us)
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_sent<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        ids: &'a [OutgoingId],
        owner: &'a Owner,
    ) -> Result<u64, sqlx::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let list: Vec<String> = (0..ids.len())
            .map(|index| format!("?{}", index + 2))
            .collect();
        let sql = format!(
            "UPDATE {} SET state = 2, sent_at = {NOW}, lease_until = NULL \
             WHERE id IN ({}) AND owner = ?1 AND state = 1",
            table.name(),
            list.join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(&owner[..]);
        for id in ids {
            query = query.bind(&id.as_uuid().as_bytes()[..]);
        }
        let done = query.execute(pool).await?;
        Ok(done.rows_affected())
    }

    async fn outbox_sent_count<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        ids: &'a [OutgoingId],
        owner: &'a Owner,
    ) -> Result<u64, sqlx::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let list: Vec<String> = (0..ids.len())
            .map(|index| format!("?{}", index + 2))
            .collect();
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE id IN ({}) AND owner = ?1 AND state = 2",
            table.name(),
            list.join(", ")
        );
        let mut query = sqlx::query_scalar(AssertSqlSafe(sql)).bind(&owner[..]);
        for id in ids {
            query = query.bind(id.as_uuid().as_bytes().to_vec());
        }
        let count: i64 = query.fetch_one(pool).await?;
        Ok(count.unsigned_abs())
    }

    async fn outbox_fail<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        id: OutgoingId,
        owner: &'a Owner,
        error: &'a str,
        delay_us: i64,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET state = ?3, owner = NULL, lease_until = NULL, last_error = ?4, \
             next_attempt_at = {} WHERE id = ?1 AND owner = ?2 AND state = 1",
            table.name(),
            later("?5")
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(&id.as_uuid().as_bytes()[..])
            .bind(&owner[..])
            .bind(if dead { 3_i64 } else { 0 })
            .bind(error)
            .bind(delay_us)
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn outbox_release<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET state = 0, owner = NULL, lease_until = NULL, attempts = attempts - 1 \
             WHERE owner = ?1 AND state = 1",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(&owner[..])
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_seen<'a>(pool: &'a Pool<Self>, table: &'a Table) -> Result<(), sqlx::Error> {
        let sql = format!(
            "INSERT INTO {} (id, last_seen) VALUES (1, {NOW}) \
             ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen",
            relay_table(table)
        );
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await?;
        Ok(())
    }

    async fn outbox_stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> Result<StatsRow, sqlx::Error> {
        let name = table.name();
        let count = |state: u8| format!("(SELECT COUNT(*) FROM {name} WHERE state = {state})");
        let since = |time: &str| {
            format!("CAST((julianday('now') - julianday({time})) * 86400000000.0 AS INTEGER)")
        };
        let sql = format!(
            "SELECT {}, {}, {}, {}, \
             (SELECT {} FROM {name} WHERE state = 0), \
             (SELECT {} FROM {} WHERE id = 1)",
            count(0),
            count(1),
            count(2),
            count(3),
            since("MIN(created_at)"),
            since("last_seen"),
            relay_table(table)
        );
        sqlx::query_as(AssertSqlSafe(sql)).fetch_one(pool).await
    }

    async fn outbox_prune<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        older_than_us: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let name = table.name();
        let sql = format!(
            "DELETE FROM {name} WHERE seq IN (SELECT seq FROM {name} WHERE state = 2 \
             AND sent_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
             printf('-%.6f seconds', ?1 / 1000000.0)) LIMIT ?2)"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(older_than_us)
            .bind(limit)
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_dead<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        limit: i64,
    ) -> Result<Vec<DeadOutgoing>, sqlx::Error> {
        let sql = format!(
            "SELECT id, destination, attempts, last_error FROM {} \
             WHERE state = 3 ORDER BY seq LIMIT ?1",
            table.name()
        );
        let rows: Vec<(Vec<u8>, String, i64, Option<String>)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(limit)
            .fetch_all(pool)
            .await?;
        rows.into_iter()
            .map(|(id, destination, attempts, last_error)| {
                Ok(DeadOutgoing {
                    id: OutgoingId::decode_bytes(&id)?,
                    destination,
                    attempts: attempts.max(0) as u32,
                    last_error,
                })
            })
            .collect()
    }

    async fn outbox_resolve<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        id: OutgoingId,
        requeue: bool,
    ) -> Result<bool, sqlx::Error> {
        // The operator's one list of what a requeue or a discard sets.
        let set = <Self as crate::operate::OperateBackend>::operate_set(
            crate::operate::Queue::Outbox,
            requeue,
        );
        let sql = format!(
            "UPDATE {} SET {set} WHERE id = ?1 AND state = 3",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(&id.as_uuid().as_bytes()[..])
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}
