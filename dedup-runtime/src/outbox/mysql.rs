//! MySQL and MariaDB: `BINARY(16)` ids, `VARBINARY` names (byte order), `LONGBLOB`
//! payloads, times in UTC on the server's clock. No partial indexes: the relay's indexes
//! lead with `state`.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, MySql, Pool};

use sqlx::Row as _;

use super::{
    DeadOutgoing, ExpiredOutgoing, Inserted, OutboxBackend, OutboxMessage, OutgoingId, Row,
    STOPPED, StatsRow, relay_table,
};
use crate::random::Owner;

use crate::dialect::mysql::{Arg, READ_COMMITTED, placeholders, update_found, update_found_in};
use crate::dialect::mysql::{ER_DUP_ENTRY, error_number};
use crate::table::Table;

/// The columns of a claimed row, as [`message`] reads them.
const MESSAGE: &str = "id, CAST(destination AS CHAR), payload, headers, \
                       CAST(ordering_key AS CHAR), attempts, seq, CAST(traceparent AS CHAR)";

/// A claimed row from the columns of [`MESSAGE`].
fn message(row: sqlx::mysql::MySqlRow) -> Result<OutboxMessage, sqlx::Error> {
    Ok(OutboxMessage {
        id: OutgoingId::decode_bytes(&row.try_get::<Vec<u8>, _>(0)?)?,
        destination: row.try_get(1)?,
        payload: row.try_get(2)?,
        headers: row.try_get(3)?,
        ordering_key: row.try_get(4)?,
        attempt: row.try_get::<i32, _>(5)?.max(0) as u32,
        seq: row.try_get(6)?,
        traceparent: row.try_get(7)?,
    })
}

impl OutboxBackend for MySql {
    fn outbox_ddl(table: &Table) -> Vec<String> {
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
             id              BINARY(16) NOT NULL,\n    \
             seq             BIGINT NOT NULL AUTO_INCREMENT,\n    \
             consumer        VARBINARY(255) NOT NULL,\n    \
             cause_id        VARBINARY(255) NOT NULL,\n    \
             slot            VARBINARY(255) NOT NULL,\n    \
             destination     VARBINARY(255) NOT NULL,\n    \
             payload         LONGBLOB NOT NULL,\n    \
             headers         MEDIUMBLOB NULL,\n    \
             ordering_key    VARBINARY(255) NULL,\n    \
             traceparent     VARBINARY(55) NULL,\n    \
             created_at      DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             state           TINYINT NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
             attempts        INT NOT NULL DEFAULT 0,\n    \
             next_attempt_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             owner           BINARY(16) NULL,\n    \
             lease_until     DATETIME(6) NULL,\n    \
             last_error      TEXT NULL,\n    \
             sent_at         DATETIME(6) NULL,\n    \
             PRIMARY KEY (id),\n    \
             UNIQUE KEY seq_key (seq),\n    \
             KEY unsent_idx (state, next_attempt_at, seq),\n    \
             KEY claimed_idx (state, lease_until),\n    \
             KEY ordering_idx (ordering_key, seq),\n    \
             KEY sent_idx (state, sent_at)\n\
             ) ENGINE = InnoDB",
                name = table.name()
            ),
            // The relays' sign of life: one row, its time the last batch's.
            format!(
                "CREATE TABLE IF NOT EXISTS {} (\n    \
                 id        TINYINT NOT NULL PRIMARY KEY CHECK (id = 1),\n    \
                 last_seen DATETIME(6) NOT NULL\n\
                 ) ENGINE = InnoDB",
                relay_table(table)
            ),
        ]
    }

    async fn outbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::mysql::create_locked(pool, Self::outbox_ddl(table)).await?;
        crate::schema::mysql::widen_headers(pool, table).await?;
        // A table made before the trace context was stored.
        crate::schema::mysql::add_missing(pool, table, "traceparent", "VARBINARY(55) NULL").await
    }

    /// A plain insert: InnoDB rolls back only the statement on its duplicate-key error
    /// (1062: only the primary key can raise it here), never the caller's transaction.
    async fn outbox_insert<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c Table,
        row: &'c Row<'c>,
    ) -> Result<Inserted, sqlx::Error> {
        let name = table.name();
        let id = row.id.as_uuid();
        let insert = format!(
            "INSERT INTO {name} (id, consumer, cause_id, slot, destination, payload, headers, \
             ordering_key, traceparent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        );
        let inserted = sqlx::query(AssertSqlSafe(insert))
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
            .await;
        match inserted {
            Ok(_) => return Ok(Inserted::Stored),
            Err(error) if error_number(&error) == Some(ER_DUP_ENTRY) => {}
            Err(error) => return Err(error),
        }
        // A locking read: the row another transaction committed after this one's snapshot.
        let select =
            format!("SELECT destination, payload FROM {name} WHERE id = ? LOCK IN SHARE MODE");
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
            "SELECT 1 FROM {} WHERE state = 1 AND lease_until <= UTC_TIMESTAMP(6) ORDER BY lease_until LIMIT 1",
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
             AND owner IN (SELECT owner FROM {name} WHERE state = 1 \
             AND lease_until <= UTC_TIMESTAMP(6)) ORDER BY owner, seq LIMIT 1000",
            name = table.name()
        );
        let rows: Vec<(Vec<u8>, Vec<u8>, i32)> =
            sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?;
        let mut expired = Vec::with_capacity(rows.len());
        for (owner, id, attempts) in rows {
            if let Ok(owner) = owner.try_into() {
                expired.push(ExpiredOutgoing {
                    owner,
                    id: OutgoingId::decode_bytes(&id)?,
                    attempts: attempts.max(0) as u32,
                });
            }
        }
        Ok(expired)
    }

    /// In one READ COMMITTED transaction, every row by primary key: the first row by its
    /// id, the others through `update_found_in`.
    async fn outbox_reclaim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        first: OutgoingId,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let name = table.name();
        let fence = "owner = ? AND state = 1";
        let first_sql = if dead {
            format!(
                "UPDATE {name} SET state = 3, owner = NULL, lease_until = NULL, \
                 last_error = CONCAT('attempt ', attempts, ?) WHERE {fence} AND id = ?"
            )
        } else {
            format!(
                "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL \
                 WHERE {fence} AND id = ?"
            )
        };
        let mut first_query = sqlx::query(AssertSqlSafe(first_sql));
        if dead {
            first_query = first_query.bind(STOPPED);
        }
        let mut tx = pool.begin_with(READ_COMMITTED).await?;
        let taken = first_query
            .bind(&owner[..])
            .bind(&first.as_uuid().as_bytes()[..])
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
        update_found_in(
            &mut tx,
            name,
            "id",
            (
                "state = 0, owner = NULL, lease_until = NULL, attempts = attempts - 1",
                &[],
            ),
            (fence, &[Arg::Bytes(&owner[..])]),
        )
        .await?;
        tx.commit().await?;
        Ok(taken)
    }

    /// `SELECT … FOR UPDATE SKIP LOCKED`, then one `UPDATE` of the ids it locked and a
    /// read of their rows, in one transaction: MySQL has no `UPDATE … RETURNING`.
    async fn outbox_claim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
        lease_us: i64,
        limit: u32,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        let name = table.name();
        let mut tx = pool.begin_with(READ_COMMITTED).await?;
        let unsent = format!(
            "SELECT id FROM {name} AS m WHERE state = 0 \
             AND next_attempt_at <= UTC_TIMESTAMP(6) \
             AND (m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {name} AS e \
             WHERE e.ordering_key = m.ordering_key AND e.seq < m.seq AND e.state <> 2)) \
             ORDER BY next_attempt_at, seq LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        let ids: Vec<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(unsent))
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        if ids.is_empty() {
            tx.rollback().await?;
            return Ok(Vec::new());
        }
        let update = format!(
            "UPDATE {name} SET state = 1, owner = ?, attempts = attempts + 1, \
             lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND WHERE id IN ({})",
            placeholders(ids.len())
        );
        let mut query = sqlx::query(AssertSqlSafe(update))
            .bind(&owner[..])
            .bind(lease_us);
        for id in &ids {
            query = query.bind(id);
        }
        query.execute(&mut *tx).await?;
        let select = format!(
            "SELECT {MESSAGE} FROM {name} WHERE id IN ({}) ORDER BY seq",
            placeholders(ids.len())
        );
        let mut query = sqlx::query(AssertSqlSafe(select));
        for id in &ids {
            query = query.bind(id);
        }
        let rows = query.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        rows.into_iter().map(message).collect()
    }

    async fn outbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
    ) -> Result<Vec<OutboxMessage>, sqlx::Error> {
        let sql = format!(
            "SELECT {MESSAGE} FROM {} WHERE owner = ? AND state = 1 ORDER BY seq",
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
        update_found(
            pool,
            table.name(),
            "id",
            (
                "lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND",
                &[Arg::I64(lease_us)],
            ),
            ("state = 1 AND owner = ?", &[Arg::Bytes(&owner[..])]),
        )
        .await
    }

    /// By primary key, the owner and state checked on each row under its lock.
    async fn outbox_sent<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        ids: &'a [OutgoingId],
        owner: &'a Owner,
    ) -> Result<u64, sqlx::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "UPDATE {} FORCE INDEX (PRIMARY) SET state = 2, sent_at = UTC_TIMESTAMP(6), \
             lease_until = NULL WHERE id IN ({}) AND owner = ? AND state = 1",
            table.name(),
            placeholders(ids.len())
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for id in ids {
            query = query.bind(&id.as_uuid().as_bytes()[..]);
        }
        let done = query.bind(&owner[..]).execute(pool).await?;
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
        let sql = format!(
            "SELECT COUNT(*) FROM {} FORCE INDEX (PRIMARY) WHERE id IN ({}) AND owner = ? \
             AND state = 2",
            table.name(),
            placeholders(ids.len())
        );
        let mut query = sqlx::query_scalar(AssertSqlSafe(sql));
        for id in ids {
            query = query.bind(id.as_uuid().as_bytes().to_vec());
        }
        let count: i64 = query.bind(&owner[..]).fetch_one(pool).await?;
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
            "UPDATE {} SET state = ?, owner = NULL, lease_until = NULL, last_error = ?, \
             next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE id = ? AND owner = ? AND state = 1",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(if dead { 3_i8 } else { 0 })
            .bind(error)
            .bind(delay_us)
            .bind(&id.as_uuid().as_bytes()[..])
            .bind(&owner[..])
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn outbox_release<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        owner: &'a Owner,
    ) -> Result<u64, sqlx::Error> {
        update_found(
            pool,
            table.name(),
            "id",
            (
                "state = 0, owner = NULL, lease_until = NULL, attempts = attempts - 1",
                &[],
            ),
            ("state = 1 AND owner = ?", &[Arg::Bytes(&owner[..])]),
        )
        .await
    }

    async fn outbox_seen<'a>(pool: &'a Pool<Self>, table: &'a Table) -> Result<(), sqlx::Error> {
        let sql = format!(
            "INSERT INTO {} (id, last_seen) VALUES (1, UTC_TIMESTAMP(6)) \
             ON DUPLICATE KEY UPDATE last_seen = UTC_TIMESTAMP(6)",
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
        let count = |state: u8| {
            format!("(SELECT CAST(COUNT(*) AS SIGNED) FROM {name} WHERE state = {state})")
        };
        let sql = format!(
            "SELECT {}, {}, {}, {}, \
             (SELECT CAST(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) AS SIGNED) \
              FROM {name} WHERE state = 0), \
             (SELECT CAST(TIMESTAMPDIFF(MICROSECOND, last_seen, UTC_TIMESTAMP(6)) AS SIGNED) \
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
        let sql = format!(
            "DELETE FROM {} WHERE state = 2 \
             AND sent_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND LIMIT ?",
            table.name()
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
            "SELECT id, CAST(destination AS CHAR), CAST(attempts AS SIGNED), last_error FROM {} \
             WHERE state = 3 ORDER BY seq LIMIT ?",
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
            "UPDATE {} SET {set} WHERE id = ? AND state = 3",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(&id.as_uuid().as_bytes()[..])
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}
