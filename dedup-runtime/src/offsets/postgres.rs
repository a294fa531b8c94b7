//! PostgreSQL: `INSERT … ON CONFLICT DO UPDATE SET next_offset = GREATEST(…)`.

use sqlx::{PgConnection, PgPool, Postgres};

use super::{OffsetRow, OffsetsBackend};

impl OffsetsBackend for Postgres {
    async fn offsets_migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
        // In a transaction whose notices below a warning are off: the table that exists
        // would otherwise be a "relation … already exists, skipping", which sqlx logs at
        // INFO, at every start.
        let create = async {
            let mut tx = pool.begin().await?;
            sqlx::raw_sql(
                "SET LOCAL client_min_messages = warning; \
                 CREATE TABLE IF NOT EXISTS dedup_kafka_offsets (\
                 consumer_group text NOT NULL, topic text NOT NULL, \
                 partition_id integer NOT NULL, next_offset bigint NOT NULL, \
                 PRIMARY KEY (consumer_group, topic, partition_id))",
            )
            .execute(&mut *tx)
            .await?;
            tx.commit().await
        };
        create.await.or_else(|error| {
            // Two consumers creating it at once: one of them fails on PostgreSQL's catalog
            // (`pg_type`'s unique index), and the table is there.
            tracing::debug!(%error, "dedup_kafka_offsets: created meanwhile?");
            Ok::<(), sqlx::Error>(())
        })?;
        sqlx::query("SELECT 1 FROM dedup_kafka_offsets LIMIT 1")
            .execute(pool)
            .await?;
        Ok(())
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
