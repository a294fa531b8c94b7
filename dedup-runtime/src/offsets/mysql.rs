//! MySQL and MariaDB: `INSERT … ON DUPLICATE KEY UPDATE next_offset = GREATEST(…)`. The
//! names are binary (`VARBINARY`): compared byte for byte, whatever the collation.

use sqlx::{MySql, MySqlConnection, MySqlPool};

use super::{OffsetRow, OffsetsBackend};

impl OffsetsBackend for MySql {
    async fn offsets_migrate(pool: &MySqlPool) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS dedup_kafka_offsets (\
         consumer_group VARBINARY(255) NOT NULL, topic VARBINARY(255) NOT NULL, \
         partition_id INT NOT NULL, next_offset BIGINT NOT NULL, \
         PRIMARY KEY (consumer_group, topic, partition_id)) ENGINE = InnoDB",
        )
        .execute(pool)
        .await?;
        Ok(())
    }

    async fn offsets_store<'c>(
        conn: &'c mut MySqlConnection,
        row: &'c OffsetRow,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO dedup_kafka_offsets (consumer_group, topic, partition_id, next_offset) \
             VALUES (?, ?, ?, ?) \
             ON DUPLICATE KEY UPDATE next_offset = GREATEST(next_offset, VALUES(next_offset))",
        )
        .bind(row.group.as_bytes())
        .bind(row.topic.as_bytes())
        .bind(row.partition)
        .bind(row.next)
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn offsets_read<'c>(
        pool: &'c MySqlPool,
        group: &'c str,
        topic: &'c str,
    ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT partition_id, next_offset FROM dedup_kafka_offsets \
             WHERE consumer_group = ? AND topic = ?",
        )
        .bind(group.as_bytes())
        .bind(topic.as_bytes())
        .fetch_all(pool)
        .await
    }
}
