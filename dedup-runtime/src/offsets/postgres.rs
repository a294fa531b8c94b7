//! PostgreSQL: `INSERT … ON CONFLICT DO UPDATE SET next_offset = GREATEST(…)`.

use sqlx::{PgConnection, PgPool, Postgres};

use super::{OffsetRow, OffsetsBackend};

impl OffsetsBackend for Postgres {
    async fn offsets_migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
        // Under the lock every `migrate` takes, so that two consumers starting at once do
        // not both create it, and quiet: a table that exists says nothing.
        let mut tx = crate::schema::postgres::begin_quiet_locked(pool).await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS dedup_kafka_offsets (\
             consumer_group text NOT NULL, topic text NOT NULL, \
             partition_id integer NOT NULL, next_offset bigint NOT NULL, \
             PRIMARY KEY (consumer_group, topic, partition_id))",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }

    async fn offsets_store<'c>(
        conn: &'c mut PgConnection,
        row: &'c OffsetRow,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO dedup_kafka_offsets (consumer_group, topic, partition_id, next_offset) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (consumer_group, topic, partition_id) \
             DO UPDATE SET next_offset = GREATEST(dedup_kafka_offsets.next_offset, \
             EXCLUDED.next_offset)",
        )
        .bind(&row.group)
        .bind(&row.topic)
        .bind(row.partition)
        .bind(row.next)
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn offsets_read<'c>(
        pool: &'c PgPool,
        group: &'c str,
        topic: &'c str,
    ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT partition_id, next_offset FROM dedup_kafka_offsets \
             WHERE consumer_group = $1 AND topic = $2",
        )
        .bind(group)
        .bind(topic)
        .fetch_all(pool)
        .await
    }
}
