//! PostgreSQL leases: numbered parameters, `clock_timestamp()` for every time, and the
//! completion's checked commit (a `SET LOCAL` in front of `COMMIT` that fails in a
//! transaction a swallowed error aborted).

use sqlx::Postgres;
use sqlx::postgres::{PgConnection, PgDatabaseError};

use super::{LeaseBackend, LeaseKey, LeaseSql, LeaseStatements, execute_numbered};
use crate::claim::Found;
use crate::rolled_back::RolledBack;
use crate::stored::{Recalled, fetch_recalled};

const BEGIN: &str = "BEGIN";
const CHECKED_COMMIT: &str = "SET LOCAL dedup.checked_commit = on; COMMIT";
const ROLLBACK: &str = "ROLLBACK";
/// in_failed_sql_transaction.
const IN_FAILED_TRANSACTION: &str = "25P02";

impl LeaseBackend for Postgres {
    fn lease_sql(statements: &LeaseStatements) -> &LeaseSql {
        &statements.postgres
    }

    async fn lease_claim<'c>(
        conn: &'c mut PgConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        state: i16,
        lease_us: i64,
        fingerprint: Option<&'c [u8]>,
    ) -> Result<bool, sqlx::Error> {
        let done = match fingerprint {
            None => {
                execute_numbered::<Self>(conn, sql.claim, key, Some(state), Some(lease_us)).await?
            }
            Some(fingerprint) => {
                sqlx::query(sql.claim_printed)
                    .bind(key.consumer)
                    .bind(key.id)
                    .bind(state)
                    .bind(&key.owner[..])
                    .bind(lease_us)
                    .bind(fingerprint)
                    .execute(conn)
                    .await?
            }
        };
        Ok(done.rows_affected() == 1)
    }

    async fn lease_take_over<'c>(
        conn: &'c mut PgConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        state: i16,
        lease_us: i64,
        fingerprint: Option<&'c [u8]>,
    ) -> Result<bool, sqlx::Error> {
        let done = match fingerprint {
            None => {
                execute_numbered::<Self>(conn, sql.take_over, key, Some(state), Some(lease_us))
                    .await?
            }
            Some(fingerprint) => {
                sqlx::query(sql.take_over_printed)
                    .bind(key.consumer)
                    .bind(key.id)
                    .bind(state)
                    .bind(&key.owner[..])
                    .bind(lease_us)
                    .bind(fingerprint)
                    .execute(conn)
                    .await?
            }
        };
        Ok(done.rows_affected() == 1)
    }

    async fn lease_inspect<'c>(
        conn: &'c mut PgConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> Result<Option<Found>, sqlx::Error> {
        let row = sqlx::query(sql.inspect)
            .bind(key.consumer)
            .bind(key.id)
            .fetch_optional(conn)
            .await?;
        row.map(|row| Found::from_postgres(&row, 0)).transpose()
    }

    async fn lease_recall<'c>(
        conn: &'c mut PgConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> Result<Option<Recalled>, sqlx::Error> {
        fetch_recalled::<Self, i32>(conn, sql.recall, key.consumer, key.id).await
    }

    async fn lease_remember<'c>(
        conn: &'c mut PgConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        result: &'c [u8],
        version: i32,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(sql.remember)
            .bind(key.consumer)
            .bind(key.id)
            .bind(&key.owner[..])
            .bind(result)
            .bind(version)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    async fn lease_owned<'c>(
        conn: &'c mut PgConnection,
        sql: &'static str,
        key: LeaseKey<'c>,
        lease_us: Option<i64>,
    ) -> Result<u64, sqlx::Error> {
        let done = execute_numbered::<Self>(conn, sql, key, None, lease_us).await?;
        Ok(done.rows_affected())
    }

    async fn lease_begin(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(BEGIN).execute(conn).await.map(drop)
    }

    async fn lease_commit<'c>(
        conn: &'c mut PgConnection,
        _: &'static LeaseSql,
        _: LeaseKey<'c>,
    ) -> Result<(), sqlx::Error> {
        match sqlx::raw_sql(CHECKED_COMMIT).execute(&mut *conn).await {
            Ok(_) => Ok(()),
            Err(error) => {
                let aborted = error
                    .as_database_error()
                    .and_then(|error| error.try_downcast_ref::<PgDatabaseError>())
                    .is_some_and(|error| error.code() == IN_FAILED_TRANSACTION);
                let _ = sqlx::raw_sql(ROLLBACK).execute(&mut *conn).await;
                Err(if aborted {
                    RolledBack::error("PostgreSQL", Some(error))
                } else {
                    error
                })
            }
        }
    }

    async fn lease_rollback(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(ROLLBACK).execute(conn).await.map(drop)
    }
}
