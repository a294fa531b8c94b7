//! MySQL and MariaDB: vendor error numbers, and the key a 1062 names in its message.

use std::error::Error as StdError;

use sqlx::MySql;
use sqlx::error::DatabaseError;
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError};

use super::{ClassifyBackend, Violation};
use crate::dialect::mysql::{ER_DUP_ENTRY, error_number};
use crate::table::Table;

/// The one message language whose 1062 format [`key_name`] parses. Only the session's
/// message language changes; it is the library's to set on connections that run
/// handlers with `unique = …` (in the same round trip as their `BEGIN`).
pub(crate) const ENGLISH: &str = "SET SESSION lc_messages = 'en_US'";

/// The key at the end of an English 1062 message, as the server names it: `key`
/// (MariaDB) or `table.key` (MySQL 8). Key names are unique only per table, so MySQL 8's
/// table is kept: it is half of the key's identity.
fn key_name(message: &str) -> Option<&str> {
    const MARKER: &str = "for key '";
    let quoted = &message[message.rfind(MARKER)? + MARKER.len()..];
    quoted.strip_suffix('\'')
}

/// `table.key` split into its table and key; a plain `key` has no table. (Names in
/// `unique` have at most one dot; a reported table name may contain dots, a key name has
/// none there.)
fn split_key(name: &str) -> (Option<&str>, &str) {
    match name.rsplit_once('.') {
        Some((table, key)) => (Some(table), key),
        None => (None, name),
    }
}

/// The tables of the connection's current database that have a unique key (or primary
/// key) named `?`. (`INDEX_NAME` compares case-insensitively, as MySQL's key names do.)
const KEY_OWNERS: &str = "SELECT DISTINCT CAST(TABLE_NAME AS CHAR) \
     FROM information_schema.STATISTICS \
     WHERE TABLE_SCHEMA = DATABASE() AND NON_UNIQUE = 0 AND INDEX_NAME = ?";

/// Which of `candidates` (names in `unique` whose key part is the violated key) a
/// violation is, given `owners`, the tables of the current database with a unique key of
/// that name, and the table the server reported (MySQL 8) if any.
///
/// The key is identified only when exactly one table has it (and it is the reported
/// table, if one was reported): then a plain name matches, and a `table.key` of that
/// table. Several tables with a key of that name, or none in this database, leave the
/// violation unidentified: an error, never a guessed duplicate.
fn resolve(
    reported_table: Option<&str>,
    candidates: &[&'static str],
    owners: &[String],
) -> Option<&'static str> {
    let [owner] = owners else {
        return None;
    };
    if reported_table.is_some_and(|table| table != owner) {
        return None;
    }
    candidates
        .iter()
        .copied()
        .find(|name| split_key(name).0.is_none_or(|table| table == owner))
}

/// ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK.
const TRANSIENT: [u16; 2] = [1205, 1213];

/// ER_NO_SUCH_TABLE: "Table '%s.%s' doesn't exist".
const ER_NO_SUCH_TABLE: u16 = 1146;

impl ClassifyBackend for MySql {
    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool {
        error
            .downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|error| TRANSIENT.contains(&error.number()))
    }

    fn is_unavailable_link(error: &dyn DatabaseError) -> bool {
        super::unavailable_sqlstate(error)
    }

    /// Error 1062 names the key only inside its message, which the server translates
    /// (`lc_messages`). Handlers with `unique = …` set the session's messages to English
    /// in the same round trip as their `BEGIN` (before their savepoint, inside a caller's
    /// transaction), so the message has the one format parsed here:
    /// `Duplicate entry '…' for key 'name'` (MariaDB) or `… for key 'table.name'` (MySQL 8).
    /// The violation is the name as reported, table and all; [`ClassifyBackend::matching`] decides
    /// which table's key it was.
    fn unique_violation_link(error: &(dyn StdError + 'static)) -> Option<Violation> {
        let error = error.downcast_ref::<MySqlDatabaseError>()?;
        if error.number() != ER_DUP_ENTRY {
            return None;
        }
        key_name(error.message()).map(|name| Violation::Named(name.to_owned()))
    }

    /// Key names are unique only per table, and MariaDB's message does not say which
    /// table's key it was: a `unique = "order_id"` must not match another table's
    /// `order_id`. MySQL 8's `table.key` matches a `unique = "table.key"` as it is;
    /// otherwise the current database's tables with a unique key of that name are looked
    /// up (the rare path: one query, on the failed transaction's connection) and
    /// [`resolve`] decides.
    fn is_missing_table(error: &sqlx::Error, _: &Table) -> bool {
        error_number(error) == Some(ER_NO_SUCH_TABLE)
    }

    async fn matching(
        conn: &mut MySqlConnection,
        violation: Violation,
        names: &'static [&'static str],
    ) -> Option<&'static str> {
        let Violation::Named(reported) = violation else {
            return None;
        };
        let (table, key) = split_key(&reported);
        let candidates: Vec<&'static str> = names
            .iter()
            .copied()
            .filter(|name| split_key(name).1 == key)
            .collect();
        if let Some(table) = table
            && let Some(name) = candidates
                .iter()
                .copied()
                .find(|name| split_key(name).0 == Some(table))
        {
            return Some(name);
        }
        if candidates.is_empty() {
            return None;
        }
        let owners: Vec<String> = match sqlx::query_scalar(KEY_OWNERS)
            .bind(key)
            .fetch_all(&mut *conn)
            .await
        {
            Ok(owners) => owners,
            Err(error) => {
                tracing::debug!(%error, key, "looking up the violated key's table failed");
                return None;
            }
        };
        let found = resolve(table, &candidates, &owners);
        if found.is_none() {
            tracing::debug!(
                key = reported.as_str(),
                ?owners,
                "a unique key named in `unique` was violated, but on which table is \
                 ambiguous: reported as an error"
            );
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::{key_name, resolve, split_key};

    #[test]
    fn key_names_from_english_messages() {
        assert_eq!(
            key_name("Duplicate entry 'o-1' for key 'shipments_order_id_key'"),
            Some("shipments_order_id_key")
        );
        // MySQL 8 names the table too: it is kept.
        assert_eq!(
            key_name("Duplicate entry 'o-1' for key 'shipments.shipments_order_id_key'"),
            Some("shipments.shipments_order_id_key")
        );
        assert_eq!(
            split_key("shipments.order_id"),
            (Some("shipments"), "order_id")
        );
        assert_eq!(split_key("order_id"), (None, "order_id"));
        assert_eq!(
            split_key("odd.table.order_id"),
            (Some("odd.table"), "order_id")
        );
        // The entry itself may contain the marker; the last one is the key's.
        assert_eq!(
            key_name("Duplicate entry 'x for key 'y' for key 'PRIMARY'"),
            Some("PRIMARY")
        );
        assert_eq!(key_name("Doppelter Eintrag 'o-1' für Schlüssel 'k'"), None);
    }

    #[test]
    fn a_key_is_identified_only_when_one_table_has_it() {
        let owners = |tables: &[&str]| -> Vec<String> {
            tables.iter().map(|table| (*table).to_owned()).collect()
        };
        let plain: &[&'static str] = &["order_id"];
        let qualified: &[&'static str] = &["shipments.order_id"];
        // MariaDB (no table reported): one table has the key.
        assert_eq!(
            resolve(None, plain, &owners(&["shipments"])),
            Some("order_id")
        );
        assert_eq!(
            resolve(None, qualified, &owners(&["shipments"])),
            Some("shipments.order_id")
        );
        assert_eq!(resolve(None, qualified, &owners(&["invoices"])), None);
        // Two tables have a key of that name, or none in this database: ambiguous.
        let twins = owners(&["shipments", "invoices"]);
        assert_eq!(resolve(None, plain, &twins), None);
        assert_eq!(resolve(None, qualified, &twins), None);
        assert_eq!(resolve(None, plain, &[]), None);
        // MySQL 8 reported the table: it must be the one table with the key.
        assert_eq!(
            resolve(Some("shipments"), plain, &owners(&["shipments"])),
            Some("order_id")
        );
        assert_eq!(
            resolve(Some("invoices"), plain, &owners(&["shipments"])),
            None
        );
        assert_eq!(resolve(Some("shipments"), plain, &twins), None);
        assert_eq!(
            resolve(
                Some("shipments"),
                &["invoices.order_id"],
                &owners(&["shipments"])
            ),
            None
        );
    }
}
