//! SQLite leases: numbered parameters, times as `processed_at`'s ISO 8601 text in UTC, and
//! a completion transaction that takes the write lock up front (`BEGIN IMMEDIATE`).

use sqlx::Sqlite;
use sqlx::sqlite::SqliteConnection;

use super::{LeaseBackend, LeaseKey, LeaseSql, LeaseStatements, execute_numbered};
use crate::claim::Found;
use crate::rolled_back::RolledBack;
use crate::stored::{Recalled, fetch_recalled};

const BEGIN: &str = "BEGIN IMMEDIATE";
const COMMIT: &str = "COMMIT";
const ROLLBACK: &str = "ROLLBACK";

impl LeaseBackend for Sqlite {
    fn lease_sql(statements: &LeaseStatements) -> &LeaseSql {
        &statements.sqlite
    }

    async fn lease_claim<'c>(
        conn: &'c mut SqliteConnection,
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
        conn: &'c mut SqliteConnection,
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
        conn: &'c mut SqliteConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> Result<Option<Found>, sqlx::Error> {
        let row = sqlx::query(sql.inspect)
            .bind(key.consumer)
            .bind(key.id)
            .fetch_optional(conn)
            .await?;
        row.map(|row| Found::from_sqlite(&row, 0)).transpose()
    }

    async fn lease_recall<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> Result<Option<Recalled>, sqlx::Error> {
        fetch_recalled::<Self, i64>(conn, sql.recall, key.consumer, key.id).await
    }

    async fn lease_remember<'c>(
        conn: &'c mut SqliteConnection,
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
        conn: &'c mut SqliteConnection,
        sql: &'static str,
        key: LeaseKey<'c>,
        lease_us: Option<i64>,
    ) -> Result<u64, sqlx::Error> {
        let done = execute_numbered::<Self>(conn, sql, key, None, lease_us).await?;
        Ok(done.rows_affected())
    }

    async fn lease_begin(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(BEGIN).execute(conn).await.map(drop)
    }

    /// A transaction SQLite rolled back by itself (`SQLITE_FULL`, an I/O error) has no
    /// `COMMIT` to answer: the error says so, and the mark was rolled back with it.
    async fn lease_commit<'c>(
        conn: &'c mut SqliteConnection,
        _: &'static LeaseSql,
        _: LeaseKey<'c>,
    ) -> Result<(), sqlx::Error> {
        match sqlx::raw_sql(COMMIT).execute(&mut *conn).await {
            Ok(_) => Ok(()),
            Err(error) => {
                let ended = sqlx::raw_sql(ROLLBACK).execute(&mut *conn).await.is_err();
                Err(if ended {
                    RolledBack::error("SQLite", Some(error))
                } else {
                    error
                })
            }
        }
    }

    async fn lease_rollback(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(ROLLBACK).execute(conn).await.map(drop)
    }
}
