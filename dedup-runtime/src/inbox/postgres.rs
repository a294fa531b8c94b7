//! PostgreSQL: `bytea` payloads, `timestamptz` times on the server's clock, partial
//! indexes for the rows a worker looks for, and a batch insert of `unnest`ed arrays.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, Pool, Postgres};

use sqlx::Row as _;
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Transaction};

use super::{
    Claimed, ClaimedMany, Expired, InboxBackend, InboxMessage, InboxOperatorBackend, MAX_BATCH,
    Owner, Row, STOPPED, StatsRow,
};
use crate::claim::postgres::revealed;
use crate::dialect::postgres::{UNFLUSHED_CLAIM, index_name};
use crate::rolled_back::RolledBack;
use crate::table::Table;

/// The transaction-local setting that tells the finishing mark its transaction is the one
/// the owner check began.
const CLAIM_SETTING: &str = "dedup.inbox_claim";

/// A pending row `m` is due only if no earlier row of its ordering key is unfinished
/// (pending, claimed or dead): one at a time per key, in receive order.
fn head(name: &str) -> String {
    format!(
        "(m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {name} AS e \
         WHERE e.consumer = m.consumer AND e.ordering_key = m.ordering_key \
         AND e.seq < m.seq AND e.state <> 2))"
    )
}

/// The marks' test of the claimed state, written so that it cannot use the partial index
/// of claimed rows (`WHERE state = 1`): a mark finds its rows by primary key. With
/// `state = 1` the planner takes that index whenever its statistics say few rows are
/// claimed (always, right after an `ANALYZE`), and reads every claimed row of the
/// consumer — and the index's dead entries since the last vacuum — for each mark.
const BY_KEY: &str = "state + 0 = 1";

/// An owner token in lowercase hex digits, as `encode(owner, 'hex')` gives it: safe in a
/// statement's text.
fn hex(owner: &[u8]) -> String {
    owner.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The columns of a claimed message, as [`message`] reads them.
const MESSAGE: &str = "message_id, payload, headers, attempts, ordering_key";

/// A claimed message from the columns of [`MESSAGE`].
fn message(row: sqlx::postgres::PgRow) -> Result<InboxMessage, sqlx::Error> {
    Ok(InboxMessage {
        id: row.try_get(0)?,
        payload: row.try_get::<Option<Vec<u8>>, _>(1)?.unwrap_or_default(),
        headers: row.try_get(2)?,
        ordering_key: row.try_get(4)?,
        attempt: row.try_get::<i32, _>(3)?.max(0) as u32,
    })
}

/// The processing transaction: `BEGIN` and a transaction-local setting of the owner
/// token, in one round trip.
async fn begin<'c>(
    conn: &'c mut PgConnection,
    owner: &Owner,
) -> Result<Transaction<'c, Postgres>, sqlx::Error> {
    let begin = format!("BEGIN; SET LOCAL {CLAIM_SETTING} = '{}'", hex(owner));
    conn.begin_with(AssertSqlSafe(begin)).await
}

impl InboxBackend for Postgres {
    fn inbox_ddl(table: &Table) -> Vec<String> {
        let name = table.name();
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 consumer        text COLLATE \"C\" NOT NULL,\n    \
                 message_id      text COLLATE \"C\" NOT NULL,\n    \
                 seq             bigint GENERATED ALWAYS AS IDENTITY,\n    \
                 payload         bytea,\n    \
                 headers         bytea,\n    \
                 ordering_key    text COLLATE \"C\",\n    \
                 received_at     timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 state           smallint NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        integer NOT NULL DEFAULT 0,\n    \
                 next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 owner           bytea,\n    \
                 lease_until     timestamptz,\n    \
                 last_error      text,\n    \
                 processed_at    timestamptz,\n    \
                 fingerprint     bytea,\n    \
                 PRIMARY KEY (consumer, message_id)\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (consumer, next_attempt_at, seq) \
                 WHERE state = 0",
                index_name(table, "pending_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (consumer, ordering_key, seq) \
                 WHERE ordering_key IS NOT NULL AND state <> 2",
                index_name(table, "ordering_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (consumer, lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (processed_at) WHERE state = 2",
                index_name(table, "processed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (consumer, seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
        ]
    }

    async fn inbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::postgres::create_locked(pool, table, Self::inbox_ddl(table)).await?;
        // A table made before the payloads' fingerprints were stored.
        crate::schema::postgres::add_missing(pool, table, "fingerprint", "bytea").await
    }

    async fn inbox_fingerprints<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        ids: &'a [&'a str],
    ) -> Result<Vec<super::StoredFingerprint>, sqlx::Error> {
        let sql = format!(
            "SELECT message_id, fingerprint FROM {} WHERE consumer = $1 AND message_id = ANY($2)",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(ids)
            .fetch_all(pool)
            .await
    }

    async fn inbox_insert<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        rows: &'a [Row<'a>],
    ) -> Result<Vec<bool>, sqlx::Error> {
        if let [row] = rows {
            let sql = format!(
                "INSERT INTO {} (consumer, message_id, payload, headers, ordering_key, \
                 fingerprint) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
                table.name()
            );
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(row.id)
                .bind(row.payload)
                .bind(row.headers)
                .bind(row.ordering_key)
                .bind(row.fingerprint())
                .execute(pool)
                .await?;
            return Ok(vec![done.rows_affected() == 1]);
        }
        // Receive order is the batch's: each row's `seq` is drawn in the batch's order
        // (PostgreSQL evaluates `nextval` after the sort of its own query level), and the
        // rows share one receive time (a worker claims by due time, then `seq`). The rows
        // are inserted in the primary key's order (the id's bytes), one order for every
        // batch, so that two overlapping batches wait for each other instead of
        // deadlocking. The sequence is looked up once per statement (`received.serial`):
        // `nextval(pg_get_serial_sequence(…))` looked it up in the catalog for every row,
        // about 5 µs each — more than a third of the statement's time for 100 rows.
        let name = table.name();
        // A batch without headers, ordering keys or fingerprints (the common one) binds
        // two arrays, not five of which three are all NULL: a tenth of the statement's
        // time (pgbench, 100 rows).
        let plain = rows.iter().all(|row| {
            row.headers.is_none() && row.ordering_key.is_none() && row.fingerprint().is_none()
        });
        let (columns, arrays) = if plain {
            ("", "")
        } else {
            (
                ", headers, ordering_key, fingerprint",
                ", $4::bytea[], $5::text[], $6::bytea[]",
            )
        };
        let sql = format!(
            "WITH numbered AS (SELECT id, payload{columns}, nextval(received.serial) AS seq, now \
             FROM unnest($2::text[], $3::bytea[]{arrays}) \
             WITH ORDINALITY AS m (id, payload{columns}, position), \
             (SELECT clock_timestamp() AS now, \
             pg_get_serial_sequence('{name}', 'seq')::regclass AS serial) AS received \
             ORDER BY position) \
             INSERT INTO {name} (consumer, message_id, payload{columns}, seq, received_at, \
             next_attempt_at) OVERRIDING SYSTEM VALUE \
             SELECT $1, id, payload{columns}, seq, now, now FROM numbered \
             ORDER BY id COLLATE \"C\" \
             ON CONFLICT DO NOTHING RETURNING message_id"
        );
        let ids: Vec<&str> = rows.iter().map(|row| row.id).collect();
        let payloads: Vec<&[u8]> = rows.iter().map(|row| row.payload).collect();
        let mut query = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(ids)
            .bind(payloads);
        if !plain {
            let headers: Vec<Option<&[u8]>> = rows.iter().map(|row| row.headers).collect();
            let keys: Vec<Option<&str>> = rows.iter().map(|row| row.ordering_key).collect();
            let fingerprints: Vec<Option<&[u8]>> = rows.iter().map(Row::fingerprint).collect();
            query = query.bind(headers).bind(keys).bind(fingerprints);
        }
        let stored: Vec<String> = query.fetch_all(pool).await?;
        let stored: HashSet<String> = stored.into_iter().collect();
        Ok(rows.iter().map(|row| stored.contains(row.id)).collect())
    }

    async fn inbox_expired<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
    ) -> Result<Vec<Expired>, sqlx::Error> {
        let sql = format!(
            "SELECT owner, message_id, attempts FROM {name} WHERE consumer = $1 AND state = 1 \
             AND owner IN (SELECT owner FROM {name} WHERE consumer = $1 AND state = 1 \
             AND lease_until <= clock_timestamp()) \
             ORDER BY owner, next_attempt_at, seq LIMIT $2",
            name = table.name()
        );
        let rows: Vec<(Vec<u8>, String, i32)> = sqlx::query_as(AssertSqlSafe(sql))
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
                    attempts: attempts.max(0) as u32,
                })
            })
            .collect())
    }

    async fn inbox_reclaim<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        first: &'a str,
        dead: bool,
    ) -> Result<bool, sqlx::Error> {
        let name = table.name();
        let fence = "consumer = $1 AND owner = $2 AND state = 1";
        let first_sql = if dead {
            format!(
                "UPDATE {name} SET state = 3, owner = NULL, lease_until = NULL, \
                 last_error = 'attempt ' || attempts || $4 WHERE {fence} AND message_id = $3"
            )
        } else {
            format!(
                "UPDATE {name} SET state = 0, owner = NULL, lease_until = NULL \
                 WHERE {fence} AND message_id = $3"
            )
        };
        let mut first_query = sqlx::query(AssertSqlSafe(first_sql))
            .bind(consumer)
            .bind(&owner[..])
            .bind(first);
        if dead {
            first_query = first_query.bind(STOPPED);
        }
        // Both in one transaction: a worker stopped between them would leave the rest
        // to a take-back that found another row first.
        let mut tx = pool.begin().await?;
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
        conn: &'a mut PgConnection,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
        limit: u32,
    ) -> Result<(Vec<InboxMessage>, bool), sqlx::Error> {
        let name = table.name();
        let head = head(name);
        // Pending rows that are due, through their partial index, skipping rows other
        // workers hold. The limit is written out, not a parameter: with `LIMIT $4` the
        // generic plan's cost is a guess at a tenth of the table, and PostgreSQL plans
        // the statement again at every call (half a millisecond, more than the claim
        // itself), where a written limit lets it settle on the generic plan.
        //
        // Joined to one row that says whether a claim's lease has ended: a look along
        // the lease index that stops at the first such row (an index scan, which marks
        // the dead entries it passes), in the claim's round trip — always one row back,
        // the message columns NULL when nothing was claimed. `UPDATE … RETURNING`
        // returns its rows in no particular order: sorted again, in the claim's order
        // (due time, then receive order), as the other backends return them.
        let pending = format!(
            "WITH claimed AS (UPDATE {name} SET state = 1, owner = $2, attempts = attempts + 1, \
             lease_until = clock_timestamp() + $3::float8 * interval '1 microsecond' \
             WHERE {UNFLUSHED_CLAIM} AND (consumer, message_id) IN (\
             SELECT consumer, message_id FROM {name} AS m WHERE consumer = $1 AND state = 0 \
             AND next_attempt_at <= clock_timestamp() AND {head} \
             ORDER BY next_attempt_at, seq LIMIT {limit} FOR UPDATE SKIP LOCKED) \
             RETURNING {MESSAGE}, next_attempt_at, seq) \
             SELECT c.message_id, c.payload, c.headers, c.attempts, c.ordering_key, x.expired \
             FROM (SELECT EXISTS (SELECT 1 FROM {name} WHERE consumer = $1 AND state = 1 \
             AND lease_until <= clock_timestamp()) AS expired) AS x \
             LEFT JOIN claimed AS c ON true ORDER BY c.next_attempt_at, c.seq"
        );
        let rows = sqlx::query(AssertSqlSafe(pending))
            .bind(consumer)
            .bind(&owner[..])
            .bind(lease_us)
            .fetch_all(&mut *conn)
            .await?;
        let mut expired = false;
        let mut messages = Vec::with_capacity(rows.len());
        for row in rows {
            expired = row.try_get(5)?;
            if row.try_get::<Option<&str>, _>(0)?.is_some() {
                messages.push(message(row)?);
            }
        }
        Ok((messages, expired))
    }

    async fn inbox_held<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
    ) -> Result<Vec<InboxMessage>, sqlx::Error> {
        let sql = format!(
            "SELECT {MESSAGE} FROM {} WHERE consumer = $1 AND owner = $2 AND state = 1 \
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

    /// `BEGIN` and a transaction-local setting of the owner token, in one round trip:
    /// gone once the transaction is (a `ROLLBACK` the handler sent), and the finishing
    /// mark requires it.
    async fn inbox_begin<'c>(
        conn: &'c mut PgConnection,
        row: &'c Claimed<'c>,
    ) -> Result<(Transaction<'c, Self>, bool), sqlx::Error> {
        Ok((begin(conn, row.owner).await?, true))
    }

    /// The owner-checked mark and the transaction's check in one statement. In a
    /// transaction a failed statement aborted, it fails with `25P02`.
    async fn inbox_finish<'c>(
        conn: &'c mut PgConnection,
        row: &'c Claimed<'c>,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "WITH marked AS (UPDATE {} SET state = 2, processed_at = clock_timestamp(), \
             lease_until = NULL{} \
             WHERE consumer = $1 AND message_id = $2 AND owner = $3 AND {BY_KEY} \
             AND current_setting('{CLAIM_SETTING}', true) = encode($3, 'hex') RETURNING 1) \
             SELECT current_setting('{CLAIM_SETTING}', true) IS NOT DISTINCT FROM \
             encode($3, 'hex'), \
             (SELECT COUNT(*) FROM marked)",
            row.table.name(),
            super::payload_dropped(row.drop_payload)
        );
        let (intact, marked): (bool, i64) = sqlx::query_as(AssertSqlSafe(sql))
            .bind(row.consumer)
            .bind(row.id)
            .bind(&row.owner[..])
            .fetch_one(conn)
            .await
            .map_err(revealed)?;
        if !intact {
            return Err(RolledBack::error("PostgreSQL", None));
        }
        Ok(marked == 1)
    }

    /// As [`inbox_begin`](InboxBackend::inbox_begin): no check, no lock.
    async fn inbox_begin_many<'c>(
        conn: &'c mut PgConnection,
        rows: &'c ClaimedMany<'c>,
    ) -> Result<(Transaction<'c, Self>, Option<Vec<String>>), sqlx::Error> {
        Ok((begin(conn, rows.owner).await?, None))
    }

    /// The owner-checked mark of every id, by primary key (`message_id = ANY($2)` under
    /// `consumer = $1`: one probe of the key per id), and the transaction's check, in one
    /// statement.
    async fn inbox_finish_many<'c>(
        conn: &'c mut PgConnection,
        rows: &'c ClaimedMany<'c>,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "WITH marked AS (UPDATE {} SET state = 2, processed_at = clock_timestamp(), \
             lease_until = NULL{} WHERE consumer = $1 AND message_id = ANY($2) \
             AND owner = $3 AND {BY_KEY} \
             AND current_setting('{CLAIM_SETTING}', true) = encode($3, 'hex') RETURNING 1) \
             SELECT current_setting('{CLAIM_SETTING}', true) IS NOT DISTINCT FROM \
             encode($3, 'hex'), \
             (SELECT COUNT(*) FROM marked)",
            rows.table.name(),
            super::payload_dropped(rows.drop_payload)
        );
        let (intact, marked): (bool, i64) = sqlx::query_as(AssertSqlSafe(sql))
            .bind(rows.consumer)
            .bind(rows.ids)
            .bind(&rows.owner[..])
            .fetch_one(conn)
            .await
            .map_err(revealed)?;
        if !intact {
            return Err(RolledBack::error("PostgreSQL", None));
        }
        Ok(marked.max(0) as u64)
    }

    async fn inbox_renew<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        owner: &'a Owner,
        lease_us: i64,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "UPDATE {} SET lease_until = clock_timestamp() + $3::float8 * interval '1 microsecond' \
             WHERE consumer = $1 AND owner = $2 AND state = 1",
            table.name()
        );
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
            "UPDATE {} SET state = $4, owner = NULL, lease_until = NULL, last_error = $5, \
             next_attempt_at = clock_timestamp() + $6::float8 * interval '1 microsecond' \
             WHERE consumer = $1 AND message_id = $2 AND owner = $3 AND state = 1",
            row.table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(row.consumer)
            .bind(row.id)
            .bind(&row.owner[..])
            .bind(if dead { 3_i16 } else { 0 })
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
             WHERE consumer = $1 AND owner = $2 AND state = 1 AND message_id <> $3",
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

impl InboxOperatorBackend for Postgres {
    async fn inbox_dead<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> Result<Vec<(String, i64, Option<String>)>, sqlx::Error> {
        let sql = format!(
            "SELECT message_id, attempts::int8, last_error FROM {} WHERE consumer = $1 AND state = 3 ORDER BY seq LIMIT $2",
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
            "UPDATE {} SET {set} WHERE consumer = $1 AND message_id = $2 AND state = 3",
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
            "DELETE FROM {name} WHERE (consumer, message_id) IN (SELECT consumer, message_id FROM {name} WHERE consumer = $1 AND state = 2 AND processed_at < clock_timestamp() - $2::float8 * interval '1 microsecond' LIMIT $3)"
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
            "SELECT COUNT(*) FROM (SELECT 1 FROM {} WHERE consumer = $1 AND state IN (0, 1) LIMIT $2) AS backlog",
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
            "SELECT COUNT(*) FILTER (WHERE state = 0), COUNT(*) FILTER (WHERE state = 1), COUNT(*) FILTER (WHERE state = 2), COUNT(*) FILTER (WHERE state = 3), (EXTRACT(EPOCH FROM clock_timestamp() - MIN(received_at) FILTER (WHERE state = 0)) * 1000000)::int8 FROM {} WHERE consumer = $1",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .fetch_one(pool)
            .await
    }
}
