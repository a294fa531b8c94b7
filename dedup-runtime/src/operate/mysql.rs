//! MySQL and MariaDB: the operator's pieces of SQL.

use sqlx::{AssertSqlSafe, MySql, MySqlConnection};

use super::Queue;
use super::backend::{OperateBackend, SummaryRow, runners};
use crate::table::Table;

impl OperateBackend for MySql {
    fn operate_placeholder(_: usize) -> String {
        "?".to_owned()
    }

    fn operate_age_us(column: &str) -> String {
        format!("CAST(TIMESTAMPDIFF(MICROSECOND, {column}, UTC_TIMESTAMP(6)) AS SIGNED)")
    }

    fn operate_contains(column: &str, parameter: &str) -> String {
        // Byte for byte: the column's collation may ignore case.
        format!("INSTR(CAST({column} AS BINARY), CAST({parameter} AS BINARY)) > 0")
    }

    fn operate_id_value(queue: Queue, parameter: &str) -> String {
        match queue {
            Queue::Inbox => parameter.to_owned(),
            Queue::Outbox => format!("UNHEX(REPLACE({parameter}, '-', ''))"),
        }
    }

    fn operate_columns(queue: Queue, cut: Option<usize>) -> String {
        let payload = match cut {
            Some(bytes) => format!("SUBSTRING(payload, 1, {bytes})"),
            None => "payload".to_owned(),
        };
        match queue {
            Queue::Inbox => format!(
                "seq, message_id, CAST(consumer AS CHAR), CAST(NULL AS CHAR), CAST(attempts AS SIGNED), last_error, {payload}, CAST(LENGTH(payload) AS SIGNED), headers, CAST(TIMESTAMPDIFF(MICROSECOND, received_at, UTC_TIMESTAMP(6)) AS SIGNED)"
            ),
            Queue::Outbox => format!(
                "seq, id, CAST(consumer AS CHAR), CAST(destination AS CHAR), CAST(attempts AS SIGNED), last_error, {payload}, CAST(LENGTH(payload) AS SIGNED), headers, CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) AS SIGNED)"
            ),
        }
    }

    fn operate_set(queue: Queue, requeue: bool) -> &'static str {
        match (queue, requeue) {
            (_, true) => {
                "state = 0, attempts = 0, next_attempt_at = UTC_TIMESTAMP(6), owner = NULL, \
                 lease_until = NULL"
            }
            (Queue::Inbox, false) => {
                "state = 2, processed_at = UTC_TIMESTAMP(6), owner = NULL, lease_until = NULL"
            }
            (Queue::Outbox, false) => {
                "state = 2, sent_at = UTC_TIMESTAMP(6), owner = NULL, lease_until = NULL"
            }
        }
    }

    runners!(MySqlConnection);

    async fn operate_summary<'a>(
        conn: &'a mut MySqlConnection,
        queue: Queue,
        table: &'a Table,
    ) -> Result<Vec<SummaryRow>, sqlx::Error> {
        let sql = format!(
            "SELECT CAST(consumer AS CHAR), CAST(COALESCE(SUM(state = 0), 0) AS SIGNED), \
             CAST(COALESCE(SUM(state = 1), 0) AS SIGNED), CAST(COALESCE(SUM(state = 2), 0) AS SIGNED), \
             CAST(COALESCE(SUM(state = 3), 0) AS SIGNED), \
             CAST(TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN state = 0 THEN {since} END), UTC_TIMESTAMP(6)) AS SIGNED) \
             FROM {} GROUP BY consumer ORDER BY consumer",
            table.name(),
            since = queue.since()
        );
        sqlx::query_as(AssertSqlSafe(sql)).fetch_all(conn).await
    }
}
