//! SQLite: the operator's pieces of SQL.

use sqlx::{AssertSqlSafe, Sqlite, SqliteConnection};

use super::Queue;
use super::backend::{OperateBackend, SummaryRow, runners};
use crate::dialect::sqlite::NOW;
use crate::table::Table;

impl OperateBackend for Sqlite {
    fn operate_placeholder(n: usize) -> String {
        format!("?{n}")
    }

    fn operate_age_us(column: &str) -> String {
        format!("CAST((julianday('now') - julianday({column})) * 86400000000.0 AS INTEGER)")
    }

    fn operate_contains(column: &str, parameter: &str) -> String {
        format!("instr({column}, {parameter}) > 0")
    }

    fn operate_id_value(queue: Queue, parameter: &str) -> String {
        match queue {
            Queue::Inbox => parameter.to_owned(),
            Queue::Outbox => format!("unhex(replace({parameter}, '-', ''))"),
        }
    }

    fn operate_columns(queue: Queue, cut: Option<usize>) -> String {
        let payload = match cut {
            Some(bytes) => format!("substr(payload, 1, {bytes})"),
            None => "payload".to_owned(),
        };
        match queue {
            Queue::Inbox => format!(
                "seq, CAST(message_id AS BLOB), consumer, NULL, attempts, last_error, {payload}, length(CAST(payload AS BLOB)), headers, CAST((julianday('now') - julianday(received_at)) * 86400000000.0 AS INTEGER)"
            ),
            Queue::Outbox => format!(
                "seq, id, consumer, destination, attempts, last_error, {payload}, length(CAST(payload AS BLOB)), headers, CAST((julianday('now') - julianday(created_at)) * 86400000000.0 AS INTEGER)"
            ),
        }
    }

    fn operate_set(queue: Queue, requeue: bool) -> &'static str {
        const REQUEUE: &str = concat!(
            "state = 0, attempts = 0, next_attempt_at = ",
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
            ", owner = NULL, lease_until = NULL"
        );
        const INBOX_DISCARD: &str = concat!(
            "state = 2, processed_at = ",
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
            ", owner = NULL, lease_until = NULL"
        );
        const OUTBOX_DISCARD: &str = concat!(
            "state = 2, sent_at = ",
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
            ", owner = NULL, lease_until = NULL"
        );
        debug_assert!(REQUEUE.contains(NOW));
        match (queue, requeue) {
            (_, true) => REQUEUE,
            (Queue::Inbox, false) => INBOX_DISCARD,
            (Queue::Outbox, false) => OUTBOX_DISCARD,
        }
    }

    runners!(SqliteConnection);

    async fn operate_summary<'a>(
        conn: &'a mut SqliteConnection,
        queue: Queue,
        table: &'a Table,
    ) -> Result<Vec<SummaryRow>, sqlx::Error> {
        let sql = format!(
            "SELECT consumer, COALESCE(SUM(state = 0), 0), COALESCE(SUM(state = 1), 0), \
             COALESCE(SUM(state = 2), 0), COALESCE(SUM(state = 3), 0), \
             CAST((julianday('now') - julianday(MIN(CASE WHEN state = 0 THEN {since} END))) * 86400000000.0 AS INTEGER) \
             FROM {} GROUP BY consumer ORDER BY consumer",
            table.name(),
            since = queue.since()
        );
        sqlx::query_as(AssertSqlSafe(sql)).fetch_all(conn).await
    }
}
