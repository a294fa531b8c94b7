//! SQLite: `INSERT … ON CONFLICT DO UPDATE SET next_offset = MAX(…)`.

use sqlx::{Sqlite, SqliteConnection, SqlitePool};

use super::{OffsetRow, OffsetsBackend};

impl OffsetsBackend for Sqlite {
    async fn offsets_migrate(pool: &SqlitePool) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS dedup_kafka_offsets (\
         consumer_group TEXT NOT NULL, topic TEXT NOT NULL, partition_id INTEGER NOT NULL, \
         next_offset INTEGER NOT NULL, PRIMARY KEY (consumer_group, topic, partition_id))",
        )
        .execute(pool)
        .await?;
        Ok(())
    }

    async fn offsets_store<'c>(
        conn: &'c mut SqliteConnection,
        row: &'c OffsetRow,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO dedup_kafka_offsets (consumer_group, topic, partition_id, next_offset) \
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer_group, topic, partition_id) \
             DO UPDATE SET next_offset = MAX(next_offset, excluded.next_offset)",
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
        pool: &'c SqlitePool,
        group: &'c str,
        topic: &'c str,
    ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT partition_id, next_offset FROM dedup_kafka_offsets \
             WHERE consumer_group = ?1 AND topic = ?2",
        )
        .bind(group)
        .bind(topic)
        .fetch_all(pool)
        .await
    }
}
