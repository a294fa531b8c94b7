//! PostgreSQL: the operator's pieces of SQL.

use sqlx::{AssertSqlSafe, PgConnection, Postgres};

use super::Queue;
use super::backend::{OperateBackend, SummaryRow, runners};
use crate::table::Table;

impl OperateBackend for Postgres {
    fn operate_placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn operate_age_us(column: &str) -> String {
        format!("(extract(epoch FROM clock_timestamp() - {column}) * 1000000)::int8")
    }

    fn operate_contains(column: &str, parameter: &str) -> String {
        format!("strpos({column}, {parameter}::text) > 0")
    }

    fn operate_id_value(queue: Queue, parameter: &str) -> String {
        match queue {
            Queue::Inbox => parameter.to_owned(),
            Queue::Outbox => format!("{parameter}::uuid"),
        }
    }

    fn operate_columns(queue: Queue, cut: Option<usize>) -> String {
        let payload = match cut {
            Some(bytes) => format!("substring(payload FROM 1 FOR {bytes})"),
            None => "payload".to_owned(),
        };
        match queue {
            Queue::Inbox => format!(
                "seq, convert_to(message_id, 'UTF8'), consumer, NULL::text, attempts::int8, last_error, {payload}, octet_length(payload)::int8, headers, (extract(epoch FROM clock_timestamp() - received_at) * 1000000)::int8"
            ),
            Queue::Outbox => format!(
                "seq, uuid_send(id), consumer, destination, attempts::int8, last_error, {payload}, octet_length(payload)::int8, headers, (extract(epoch FROM clock_timestamp() - created_at) * 1000000)::int8"
            ),
        }
    }

    fn operate_set(queue: Queue, requeue: bool) -> &'static str {
        match (queue, requeue) {
            (_, true) => {
                "state = 0, attempts = 0, next_attempt_at = clock_timestamp(), owner = NULL, \
                 lease_until = NULL"
            }
            (Queue::Inbox, false) => {
                "state = 2, processed_at = clock_timestamp(), owner = NULL, lease_until = NULL"
            }
            (Queue::Outbox, false) => {
                "state = 2, sent_at = clock_timestamp(), owner = NULL, lease_until = NULL"
            }
        }
    }

    runners!(PgConnection);

    async fn operate_summary<'a>(
        conn: &'a mut PgConnection,
        queue: Queue,
        table: &'a Table,
    ) -> Result<Vec<SummaryRow>, sqlx::Error> {
        let sql = format!(
            "SELECT consumer, count(*) FILTER (WHERE state = 0), count(*) FILTER (WHERE state = 1), \
             count(*) FILTER (WHERE state = 2), count(*) FILTER (WHERE state = 3), \
             (extract(epoch FROM clock_timestamp() - min({since}) FILTER (WHERE state = 0)) * 1000000)::int8 \
             FROM {} GROUP BY consumer ORDER BY consumer",
            table.name(),
            since = queue.since()
        );
        sqlx::query_as(AssertSqlSafe(sql)).fetch_all(conn).await
    }
}
