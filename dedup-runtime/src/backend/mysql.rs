//! MySQL and MariaDB: plain insert, duplicate key 1062 means a duplicate; vendor codes.

use std::error::Error as StdError;

use sqlx::mysql::{MySqlConnection, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, Connection, MySql, Pool, Transaction};

use super::{Backend, Statements, Violation};
use crate::migrate::Table;

super::connection_impls!(MySql, MySqlConnection);

const ER_DUP_ENTRY: u16 = 1062;
/// Error messages in the one language whose 1062 format we parse. Only the session's
/// message language changes; it is the library's to set on connections that run
/// handlers with `unique = …`.
const ENGLISH: &str = "SET SESSION lc_messages = 'en_US'";
const ENGLISH_THEN_BEGIN: &str = "SET SESSION lc_messages = 'en_US'; BEGIN";

/// The key name at the end of an English 1062 message.
fn key_name(message: &str) -> Option<&str> {
    const MARKER: &str = "for key '";
    let quoted = &message[message.rfind(MARKER)? + MARKER.len()..];
    let name = quoted.strip_suffix('\'')?;
    // MySQL 8 qualifies the key with its table; key names cannot contain a dot unquoted.
    Some(name.rsplit('.').next().unwrap_or(name))
}

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
        business_keys: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        if business_keys {
            conn.begin_with(ENGLISH_THEN_BEGIN)
        } else {
            conn.begin_with("BEGIN")
        }
    }

    fn begin_pool(
        pool: &Pool<Self>,
        business_keys: bool,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_ {
        pool.begin_with(if business_keys {
            ENGLISH_THEN_BEGIN
        } else {
            "BEGIN"
        })
    }

    async fn begin_nested(
        conn: &mut MySqlConnection,
        business_keys: bool,
    ) -> Result<Transaction<'_, Self>, sqlx::Error> {
        if business_keys {
            sqlx::raw_sql(ENGLISH).execute(&mut *conn).await?;
        }
        conn.begin().await
    }

    /// Error 1062 names the key only inside its message, which the server translates
    /// (`lc_messages`). Handlers with `unique = …` set the session's messages to English
    /// in the same round trip as their `BEGIN` (before their savepoint, inside a caller's
    /// transaction), so the message has the one format parsed here:
    /// `Duplicate entry '…' for key 'name'` (MariaDB) or `… for key 'table.name'` (MySQL 8).
    fn unique_violation_link(error: &(dyn StdError + 'static)) -> Option<Violation> {
        let error = error.downcast_ref::<MySqlDatabaseError>()?;
        if error.number() != ER_DUP_ENTRY {
            return None;
        }
        key_name(error.message()).map(|name| Violation::Named(name.to_owned()))
    }

    async fn matching(
        _: &mut MySqlConnection,
        violation: Violation,
        names: &'static [&'static str],
    ) -> Option<&'static str> {
        super::matching_name(&violation, names)
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

#[cfg(test)]
mod tests {
    use super::key_name;

    #[test]
    fn key_names_from_english_messages() {
        assert_eq!(
            key_name("Duplicate entry 'o-1' for key 'shipments_order_id_key'"),
            Some("shipments_order_id_key")
        );
        assert_eq!(
            key_name("Duplicate entry 'o-1' for key 'shipments.shipments_order_id_key'"),
            Some("shipments_order_id_key")
        );
        // The entry itself may contain the marker; the last one is the key's.
        assert_eq!(
            key_name("Duplicate entry 'x for key 'y' for key 'PRIMARY'"),
            Some("PRIMARY")
        );
        assert_eq!(key_name("Doppelter Eintrag 'o-1' für Schlüssel 'k'"), None);
    }
}
