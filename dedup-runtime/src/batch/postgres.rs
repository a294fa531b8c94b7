//! PostgreSQL: `INSERT … SELECT … FROM unnest($2) ON CONFLICT DO NOTHING RETURNING`
//! (`unnest($2, $3)` with the fingerprints).

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Postgres, Row};

use super::{BatchBackend, Inspected};
use crate::claim::Found;
use crate::table::Table;

impl BatchBackend for Postgres {
    async fn claim_many<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        prints: Option<&'c [&'c [u8]]>,
        _: &'c [u8; 16],
    ) -> Result<Vec<String>, sqlx::Error> {
        // `WITH ORDINALITY … ORDER BY`: the rows go in the array's order (byte order).
        let Some(prints) = prints else {
            let sql = format!(
                "INSERT INTO {} (consumer, message_id, processed_at) \
                 SELECT $1, id, clock_timestamp() FROM unnest($2::text[]) WITH ORDINALITY AS u(id, n) \
                 ORDER BY n ON CONFLICT DO NOTHING RETURNING message_id",
                table.name()
            );
            return sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(ids)
                .fetch_all(conn)
                .await;
        };
        let sql = format!(
            "INSERT INTO {} (consumer, message_id, processed_at, fingerprint) \
             SELECT $1, id, clock_timestamp(), f FROM unnest($2::text[], $3::bytea[]) \
             WITH ORDINALITY AS u(id, f, n) \
             ORDER BY n ON CONFLICT DO NOTHING RETURNING message_id",
            table.name()
        );
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(ids)
            .bind(prints)
            .fetch_all(conn)
            .await
    }

    async fn inspect_many<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        printed: bool,
    ) -> Result<Vec<Inspected>, sqlx::Error> {
        // By name once the table has the columns; a table of migration `0001` has neither (and only
        // processed rows): through the row's JSON there, since an error would abort the
        // batch's transaction. (Fingerprints need the upgraded table, as `migrate` makes.)
        let (state, expires_at) =
            if printed || crate::schema::postgres::upgraded(&mut *conn, table.name()).await? {
                ("p.state", "p.expires_at")
            } else {
                (
                    "(to_jsonb(p) ->> 'state')::int2",
                    "(to_jsonb(p) ->> 'expires_at')::timestamptz",
                )
            };
        let fingerprint = if printed { ", p.fingerprint" } else { "" };
        let sql = format!(
            "SELECT message_id, {state}, GREATEST(0, (EXTRACT(EPOCH \
             FROM {expires_at} - clock_timestamp()) * 1000000)::int8){fingerprint} FROM {} p \
             WHERE consumer = $1 AND message_id = ANY($2::text[])",
            table.name()
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(ids)
            .fetch_all(conn)
            .await?;
        rows.into_iter()
            .map(|row| {
                Ok(Inspected {
                    id: row.try_get(0)?,
                    found: Found::from_postgres(&row, 1)?,
                    fingerprint: if printed { row.try_get(3)? } else { None },
                })
            })
            .collect()
    }

    async fn take_over_one<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        consumer: &'c str,
        id: &'c str,
        print: Option<&'c [u8]>,
        _: &'c [u8; 16],
    ) -> Result<bool, sqlx::Error> {
        let (set, only) = match print {
            Some(_) => (
                ", fingerprint = $3",
                " AND (fingerprint IS NULL OR fingerprint = $3)",
            ),
            None => ("", ""),
        };
        let sql = format!(
            "UPDATE {} SET state = NULL, owner = NULL, expires_at = NULL, \
             processed_at = clock_timestamp(){set} \
             WHERE consumer = $1 AND message_id = $2 AND state = 1 \
             AND expires_at <= clock_timestamp(){only}",
            table.name()
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(consumer).bind(id);
        if let Some(print) = print {
            query = query.bind(print);
        }
        Ok(query.execute(conn).await?.rows_affected() == 1)
    }

    async fn seal_many<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        consumer: &'c str,
        fresh: &'c [&'c str],
        _: &'c [u8; 16],
        slow: bool,
    ) -> Result<(), sqlx::Error> {
        if !slow {
            return Ok(());
        }
        let sql = format!(
            "UPDATE {} SET processed_at = clock_timestamp() \
             WHERE consumer = $1 AND message_id = ANY($2::text[])",
            table.name()
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(fresh)
            .execute(conn)
            .await
            .map(drop)
            .map_err(crate::claim::postgres::revealed)
    }
}
