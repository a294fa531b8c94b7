//! MySQL and MariaDB leases: positional parameters (bound in the order the text names
//! them), `UTC_TIMESTAMP(6)` for every time, a claim whose duplicate-key error (1062) is
//! the row already there, and a completion transaction out of autocommit mode whose
//! commit checks first that the mark is still in it (InnoDB ends a transaction by itself
//! on a deadlock: the body's later writes would go into a new one).

use sqlx::MySql;
use sqlx::mysql::MySqlConnection;

use super::{LeaseBackend, LeaseKey, LeaseSql, LeaseStatements};
use crate::claim::Found;
use crate::dialect::mysql::{ER_DUP_ENTRY, error_number};
use crate::rolled_back::RolledBack;
use crate::stored::{Recalled, fetch_recalled};

const BEGIN: &str = "SET autocommit = 0; BEGIN";
const COMMIT: &str = "COMMIT; SET autocommit = 1";
const ROLLBACK: &str = "ROLLBACK; SET autocommit = 1";
/// ER_SUBQUERY_NO_1_ROW: the check found the mark gone.
const MARK_GONE: u16 = 1242;

impl LeaseBackend for MySql {
    fn lease_sql(statements: &LeaseStatements) -> &LeaseSql {
        &statements.mysql
    }

    async fn lease_claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        state: i16,
        lease_us: i64,
        fingerprint: Option<&'c [u8]>,
    ) -> Result<bool, sqlx::Error> {
        let statement = if fingerprint.is_some() {
            sql.claim_printed
        } else {
            sql.claim
        };
        let mut query = sqlx::query(statement)
            .bind(key.consumer)
            .bind(key.id)
            .bind(state)
            .bind(&key.owner[..])
            .bind(lease_us);
        if let Some(fingerprint) = fingerprint {
            query = query.bind(fingerprint);
        }
        let result = query.execute(conn).await;
        match result {
            Ok(_) => Ok(true),
            Err(error) if error_number(&error) == Some(ER_DUP_ENTRY) => Ok(false),
            Err(error) => Err(error),
        }
    }

    async fn lease_take_over<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        state: i16,
        lease_us: i64,
        fingerprint: Option<&'c [u8]>,
    ) -> Result<bool, sqlx::Error> {
        let statement = if fingerprint.is_some() {
            sql.take_over_printed
        } else {
            sql.take_over
        };
        let mut query = sqlx::query(statement)
            .bind(&key.owner[..])
            .bind(state)
            .bind(lease_us);
        if let Some(fingerprint) = fingerprint {
            query = query.bind(fingerprint);
        }
        query = query.bind(key.consumer).bind(key.id);
        if let Some(fingerprint) = fingerprint {
            query = query.bind(fingerprint);
        }
        let done = query.execute(conn).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn lease_inspect<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> Result<Option<Found>, sqlx::Error> {
        let row = sqlx::query(sql.inspect)
            .bind(key.consumer)
            .bind(key.id)
            .fetch_optional(conn)
            .await?;
        row.map(|row| Found::from_mysql(&row, 0)).transpose()
    }

    async fn lease_recall<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> Result<Option<Recalled>, sqlx::Error> {
        fetch_recalled::<Self, i32>(conn, sql.recall, key.consumer, key.id).await
    }

    async fn lease_remember<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        result: &'c [u8],
        version: i32,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(sql.remember)
            .bind(result)
            .bind(version)
            .bind(key.consumer)
            .bind(key.id)
            .bind(&key.owner[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    async fn lease_owned<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static str,
        key: LeaseKey<'c>,
        lease_us: Option<i64>,
    ) -> Result<u64, sqlx::Error> {
        let query = sqlx::query(sql);
        let query = match lease_us {
            Some(lease_us) => query.bind(lease_us),
            None => query,
        };
        let done = query
            .bind(key.consumer)
            .bind(key.id)
            .bind(&key.owner[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    async fn lease_begin(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(BEGIN).execute(conn).await.map(drop)
    }

    async fn lease_commit<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> Result<(), sqlx::Error> {
        let checked = match Self::lease_owned(conn, sql.check, key, None).await {
            Ok(_) => sqlx::raw_sql(COMMIT).execute(&mut *conn).await.map(drop),
            Err(error) => Err(error),
        };
        match checked {
            Ok(()) => Ok(()),
            Err(error) => {
                let gone = error_number(&error) == Some(MARK_GONE);
                let _ = sqlx::raw_sql(ROLLBACK).execute(&mut *conn).await;
                Err(if gone {
                    RolledBack::error("MySQL", Some(error))
                } else {
                    error
                })
            }
        }
    }

    async fn lease_rollback(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(ROLLBACK).execute(conn).await.map(drop)
    }
}
