//! MySQL and MariaDB: plain insert, duplicate key 1062 means a duplicate; vendor codes.

use std::error::Error as StdError;

use sqlx::mysql::{MySqlConnection, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, Connection, MySql, Pool, Transaction};

use super::{Backend, Statements};
use crate::migrate::Table;

super::connection_impls!(MySql, MySqlConnection);

const ER_DUP_ENTRY: u16 = 1062;
/// ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK.
const TRANSIENT: [u16; 2] = [1205, 1213];

impl Backend for MySql {
    fn claim_sql(statements: &Statements) -> &'static str {
        statements.mysql
    }

    async fn claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<bool, sqlx::Error> {
        let result = sqlx::query(sql).bind(consumer).bind(id).execute(conn).await;
        match result {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(error))
                if error
                    .try_downcast_ref::<MySqlDatabaseError>()
                    .is_some_and(|error| error.number() == ER_DUP_ENTRY) =>
            {
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }

    fn begin_owned(
        conn: &mut MySqlConnection,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin()
    }

    fn begin_pool(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_ {
        pool.begin()
    }

    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool {
        error
            .downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|error| TRANSIENT.contains(&error.number()))
    }

    fn ddl(table: &Table) -> Vec<String> {
        // VARBINARY: ids compare byte for byte, with no case folding and no PAD SPACE
        // (`a` and `a ` are different messages).
        let name = table.name();
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {name} (\n    \
             consumer     VARBINARY(255) NOT NULL,\n    \
             message_id   VARBINARY(255) NOT NULL,\n    \
             processed_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),\n    \
             PRIMARY KEY (consumer, message_id),\n    \
             KEY processed_at_idx (processed_at)\n\
             ) ENGINE = InnoDB"
        )]
    }

    async fn create(pool: &Pool<Self>, ddl: Vec<String>) -> Result<(), sqlx::Error> {
        // MySQL DDL commits implicitly; `IF NOT EXISTS` under the metadata lock is enough.
        let mut conn = pool.acquire().await?;
        for statement in ddl {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}
