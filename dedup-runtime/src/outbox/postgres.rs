//! PostgreSQL: `uuid` ids, `bytea` payloads, `timestamptz` times on the server's clock,
//! partial indexes for the rows a relay looks for.

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Pool, Postgres};

use sqlx::Row as _;

use super::{
    DeadOutgoing, ExpiredOutgoing, Inserted, OutboxBackend, OutboxMessage, OutgoingId, Row,
    STOPPED, StatsRow, relay_table,
};
use crate::dialect::postgres::{UNFLUSHED_CLAIM, index_name};
use crate::random::Owner;
use crate::table::Table;

/// The columns of a claimed row, as [`message`] reads them.
const MESSAGE: &str =
    "id::text, destination, payload, headers, ordering_key, attempts, seq, traceparent";

/// A claimed row from the columns of [`MESSAGE`].
fn message(row: sqlx::postgres::PgRow) -> Result<OutboxMessage, sqlx::Error> {
    Ok(OutboxMessage {
        id: OutgoingId::decode_text(&row.try_get::<String, _>(0)?)?,
        destination: row.try_get(1)?,
        payload: row.try_get(2)?,
        headers: row.try_get(3)?,
        ordering_key: row.try_get(4)?,
        attempt: row.try_get::<i32, _>(5)?.max(0) as u32,
        seq: row.try_get(6)?,
        traceparent: row.try_get(7)?,
    })
}

impl OutboxBackend for Postgres {
    fn outbox_ddl(table: &Table) -> Vec<String> {
        let name = table.name();
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 id              uuid PRIMARY KEY,\n    \
                 seq             bigint GENERATED ALWAYS AS IDENTITY,\n    \
                 consumer        text COLLATE \"C\" NOT NULL,\n    \
                 cause_id        text COLLATE \"C\" NOT NULL,\n    \
                 slot            text COLLATE \"C\" NOT NULL,\n    \
                 destination     text COLLATE \"C\" NOT NULL,\n    \
                 payload         bytea NOT NULL,\n    \
                 headers         bytea,\n    \
                 ordering_key    text COLLATE \"C\",\n    \
                 traceparent     text,\n    \
                 created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 state           smallint NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        integer NOT NULL DEFAULT 0,\n    \
                 next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 owner           bytea,\n    \
                 lease_until     timestamptz,\n    \
                 last_error      text,\n    \
                 sent_at         timestamptz\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (next_attempt_at, seq) WHERE state = 0",
                index_name(table, "unsent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (ordering_key, seq) \
                 WHERE ordering_key IS NOT NULL AND state <> 2",
                index_name(table, "ordering_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (sent_at) WHERE state = 2",
                index_name(table, "sent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
            // The relays' sign of life: one row, its time the last batch's.
            format!(
                "CREATE TABLE IF NOT EXISTS {} (\n    \
                 id        smallint PRIMARY KEY CHECK (id = 1),\n    \
                 last_seen timestamptz NOT NULL\n)",
                relay_table(table)
            ),
        ]
    }

    async fn outbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::postgres::create_locked(pool, table, Self::outbox_ddl(table)).await?;
        // A table made before the trace context was stored.
        crate::schema::postgres::add_missing(pool, table, "traceparent", "text").await
    }

    /// `ON CONFLICT DO NOTHING`: a duplicate never aborts the caller's transaction.
    async fn outbox_insert<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        row: &'c Row<'c>,
    ) -> Result<Inserted, sqlx::Error> {
        let name = table.name();
        let id = row.id.to_string();
        let insert = format!(
            "INSERT INTO {name} (id, consumer, cause_id, slot, destination, payload, headers, \
             ordering_key, traceparent) VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (id) DO NOTHING"
        );
        let done = sqlx::query(AssertSqlSafe(insert))
            .bind(&id)
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
        let select = format!(
            "SELECT convert_to(destination, 'UTF8'), payload FROM {name} WHERE id = $1::uuid"
        );
        let (destination, payload): (Vec<u8>, Vec<u8>) = sqlx::query_as(AssertSqlSafe(select))
            .bind(&id)
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
            "SELECT 1 FROM {} WHERE state = 1 AND lease_until <= clock_timestamp() ORDER BY lease_until LIMIT 1",
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
            "SELECT owner, id::text, attempts FROM {name} WHERE state = 1 \
             AND owner IN (SELECT owner FROM {name} WHERE state = 1 \
             AND lease_until <= clock_timestamp()) ORDER BY owner, seq LIMIT 1000",
            name = table.name()
        );
        let rows: Vec<(Vec<u8>, String, i32)> =
            sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?;
        let mut expired = Vec::with_capacity(rows.len());
        for (owner, id, attempts) in rows {
            if let Ok(owner) = owner.try_into() {
                expired.push(ExpiredOutgoing {
                    owner,
                    id: OutgoingId::decode_text(&id)?,
                    attempts: attempts.max(0) as u32,
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
        let fence = "owner = $1 AND state = 1";
        let first_sql = if dead {
            format!(
                "UPDATE {name} SET state = 3, owner = NULL, lease_until = NULL, \
                 last_error = 'attempt ' || attempts || $3 WHERE {fence} AND id = $2::uuid"
            )
        } else {
            format!(
                "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL \
                 WHERE {fence} AND id = $2::uuid"
            )
        };
        let mut first_query = sqlx::query(AssertSqlSafe(first_sql))
            .bind(&owner[..])
            .bind(first.to_string());
        if dead {
            first_query = first_query.bind(STOPPED);
        }
        let mut tx = pool.begin().await?;
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
        // Unsent rows that are due, through their partial index, skipping rows other
        // relays hold (the limit written out, as the inbox's claim does, so that the
        // statement is not planned again at every call); `UPDATE … RETURNING` returns them in no particular order: sorted
        // again, in the claim's order.
        let unsent = format!(
            "WITH claimed AS (UPDATE {name} SET state = 1, owner = $1, attempts = attempts + 1, \
             lease_until = clock_timestamp() + $2::float8 * interval '1 microsecond' \
             WHERE {UNFLUSHED_CLAIM} AND id IN (SELECT id FROM {name} AS m WHERE state = 0 \
             AND next_attempt_at <= clock_timestamp() \
             AND (m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {name} AS e \
             WHERE e.ordering_key = m.ordering_key AND e.seq < m.seq AND e.state <> 2)) \
             ORDER BY next_attempt_at, seq LIMIT {limit} FOR UPDATE SKIP LOCKED) \
             RETURNING {MESSAGE}) SELECT * FROM claimed ORDER BY seq"
        );
        let rows = sqlx::query(AssertSqlSafe(unsent))
            .bind(&owner[..])
            .bind(lease_us)
            .fetch_all(pool)
            .await?;
        rows.into_iter().map(message).collect()
    }

    async fn outbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        let sql = format!(
            "SELECT {MESSAGE} FROM {} WHERE owner = $1 AND state = 1 ORDER BY seq",
            table.name()
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(&owner[..])
            .fetch_all(pool)
            .await?;
        rows.into_iter().map(message).collect()
    }

    async fn outbox_renew<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        lease_us: i64,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET lease_until = clock_timestamp() + $2::float8 * interval '1 microsecond' \
             WHERE owner = $1 AND state = 1",
            table.name()
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
        // A join with the ids, not `id = ANY($1)`: the planner, which counts few claimed
        // rows, walks the claimed rows' index and tests each against the whole array
        // (500 × 500 comparisons: 90 ms for a claim of 500); the join is linear (5 ms).
        let sql = format!(
            "UPDATE {} AS t SET state = 2, sent_at = clock_timestamp(), lease_until = NULL \
             FROM unnest($1::text[]::uuid[]) AS s (id) \
             WHERE t.id = s.id AND t.owner = $2 AND t.state = 1",
            table.name()
        );
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(ids)
            .bind(&owner[..])
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_sent_count<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        ids: &'a [OutgoingId],
        owner: &'a Owner,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "SELECT count(*) FROM {} AS t JOIN unnest($1::text[]::uuid[]) AS s (id) \
             ON t.id = s.id WHERE t.owner = $2 AND t.state = 2",
            table.name()
        );
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        let count: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(ids)
            .bind(&owner[..])
            .fetch_one(pool)
            .await?;
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
            "UPDATE {} SET state = $3, owner = NULL, lease_until = NULL, last_error = $4, \
             next_attempt_at = clock_timestamp() + $5::float8 * interval '1 microsecond' \
             WHERE id = $1::uuid AND owner = $2 AND state = 1",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(id.to_string())
            .bind(&owner[..])
            .bind(if dead { 3_i16 } else { 0 })
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
             WHERE owner = $1 AND state = 1",
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
            "INSERT INTO {} (id, last_seen) VALUES (1, clock_timestamp()) \
             ON CONFLICT (id) DO UPDATE SET last_seen = EXCLUDED.last_seen",
            relay_table(table)
        );
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await?;
        Ok(())
    }

    /// Each count through its partial index.
    async fn outbox_stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> Result<StatsRow, sqlx::Error> {
        let name = table.name();
        let count = |state: u8| format!("(SELECT COUNT(*) FROM {name} WHERE state = {state})");
        let sql = format!(
            "SELECT {}, {}, {}, {}, \
             (SELECT (EXTRACT(EPOCH FROM clock_timestamp() - MIN(created_at)) * 1000000)::int8 \
              FROM {name} WHERE state = 0), \
             (SELECT (EXTRACT(EPOCH FROM clock_timestamp() - last_seen) * 1000000)::int8 \
              FROM {} WHERE id = 1)",
            count(0),
            count(1),
            count(2),
            count(3),
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
            "DELETE FROM {name} WHERE id IN (SELECT id FROM {name} WHERE state = 2 \
             AND sent_at < clock_timestamp() - $1::float8 * interval '1 microsecond' LIMIT $2)"
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
            "SELECT id::text, destination, attempts::int8, last_error FROM {} \
             WHERE state = 3 ORDER BY seq LIMIT $1",
            table.name()
        );
        let rows: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(limit)
            .fetch_all(pool)
            .await?;
        rows.into_iter()
            .map(|(id, destination, attempts, last_error)| {
                Ok(DeadOutgoing {
                    id: OutgoingId::decode_text(&id)?,
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
            "UPDATE {} SET {set} WHERE id = $1::uuid AND state = 3",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(id.to_string())
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}
