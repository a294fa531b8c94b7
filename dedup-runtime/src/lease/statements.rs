//! The statements of a dedup table's leases ([`LeaseStatements`], one [`LeaseSql`] per
//! backend), written at compile time by `__lease_statements!` for the table a handler
//! names.

/// The statements of one dedup table's leases, fixed at compile time.
#[doc(hidden)]
#[derive(Debug)]
pub struct LeaseStatements {
    pub postgres: LeaseSql,
    pub sqlite: LeaseSql,
    pub mysql: LeaseSql,
}

/// One backend's lease statements.
#[doc(hidden)]
#[derive(Debug)]
pub struct LeaseSql {
    /// Inserts the row in progress, or does nothing (MySQL: fails with 1062).
    pub claim: &'static str,
    /// Takes over an expired send-first lease (`state = 1`) with a new token.
    pub take_over: &'static str,
    /// The row's `state` and the microseconds left until `expires_at`.
    pub inspect: &'static str,
    /// Moves `expires_at`, owner-checked.
    pub extend: &'static str,
    /// Deletes the row, owner-checked and only while it is not processed.
    pub release: &'static str,
    /// Marks the row processed, owner-checked.
    pub complete: &'static str,
    /// MySQL: fails (1242) unless the row is processed by this owner, before `COMMIT`.
    pub check: &'static str,
    /// `claim` with the payload's fingerprint (`fingerprint = …`), the last parameter.
    pub claim_printed: &'static str,
    /// `take_over` with the payload's fingerprint, the last parameter: written as
    /// `claim_printed` writes it (the row may have been claimed without one, by a
    /// handler of before `fingerprint = …`), and only over a row that has none or the
    /// same one (its recall compared them before; this keeps it so in between).
    pub take_over_printed: &'static str,
    /// What the row remembers: its result, the result's version, its fingerprint.
    pub recall: &'static str,
    /// Writes the result and its version, owner-checked, in the completion transaction.
    pub remember: &'static str,
}

/// The lease statements for a table name literal, as a `&'static LeaseStatements`.
#[doc(hidden)]
#[macro_export]
macro_rules! __lease_statements {
    ($table:literal) => {{
        const STATEMENTS: &$crate::__private::LeaseStatements =
            &$crate::__private::LeaseStatements {
                postgres: $crate::__private::LeaseSql {
                    claim: ::core::concat!(
                        "INSERT INTO ", $table,
                        " (consumer, message_id, processed_at, state, owner, expires_at) \
                         VALUES ($1, $2, clock_timestamp(), $3, $4, \
                         clock_timestamp() + $5::float8 * interval '1 microsecond') \
                         ON CONFLICT DO NOTHING"
                    ),
                    take_over: ::core::concat!(
                        "UPDATE ", $table,
                        " SET owner = $4, state = $3, processed_at = clock_timestamp(), \
                         expires_at = clock_timestamp() + $5::float8 * interval '1 microsecond' \
                         WHERE consumer = $1 AND message_id = $2 AND state = 1 \
                         AND expires_at <= clock_timestamp()"
                    ),
                    inspect: ::core::concat!(
                        "SELECT state, GREATEST(0, (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) \
                         * 1000000)::int8) FROM ", $table,
                        " WHERE consumer = $1 AND message_id = $2"
                    ),
                    extend: ::core::concat!(
                        "UPDATE ", $table,
                        " SET expires_at = clock_timestamp() + $4::float8 * interval '1 microsecond' \
                         WHERE consumer = $1 AND message_id = $2 AND owner = $3 AND state IS NOT NULL"
                    ),
                    release: ::core::concat!(
                        "DELETE FROM ", $table,
                        " WHERE consumer = $1 AND message_id = $2 AND owner = $3 AND state IS NOT NULL"
                    ),
                    complete: ::core::concat!(
                        "UPDATE ", $table,
                        " SET state = NULL, expires_at = NULL, processed_at = clock_timestamp() \
                         WHERE consumer = $1 AND message_id = $2 AND owner = $3 AND state IS NOT NULL"
                    ),
                    check: "",
                    claim_printed: ::core::concat!(
                        "INSERT INTO ", $table,
                        " (consumer, message_id, processed_at, state, owner, expires_at, fingerprint) \
                         VALUES ($1, $2, clock_timestamp(), $3, $4, \
                         clock_timestamp() + $5::float8 * interval '1 microsecond', $6) \
                         ON CONFLICT DO NOTHING"
                    ),
                    take_over_printed: ::core::concat!(
                        "UPDATE ", $table,
                        " SET owner = $4, state = $3, processed_at = clock_timestamp(), \
                         expires_at = clock_timestamp() + $5::float8 * interval '1 microsecond', \
                         fingerprint = $6 \
                         WHERE consumer = $1 AND message_id = $2 AND state = 1 \
                         AND expires_at <= clock_timestamp() \
                         AND (fingerprint IS NULL OR fingerprint = $6)"
                    ),
                    recall: ::core::concat!(
                        "SELECT result, result_version, fingerprint FROM ", $table,
                        " WHERE consumer = $1 AND message_id = $2"
                    ),
                    remember: ::core::concat!(
                        "UPDATE ", $table,
                        " SET result = $4, result_version = $5 \
                         WHERE consumer = $1 AND message_id = $2 AND owner = $3"
                    ),
                },
                sqlite: $crate::__private::LeaseSql {
                    claim: ::core::concat!(
                        "INSERT INTO ", $table,
                        " (consumer, message_id, state, owner, expires_at) \
                         VALUES (?1, ?2, ?3, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                         printf('%+.6f seconds', ?5 / 1000000.0))) ON CONFLICT DO NOTHING"
                    ),
                    take_over: ::core::concat!(
                        "UPDATE ", $table,
                        " SET owner = ?4, state = ?3, \
                         processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
                         expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                         printf('%+.6f seconds', ?5 / 1000000.0)) \
                         WHERE consumer = ?1 AND message_id = ?2 AND state = 1 \
                         AND expires_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
                    ),
                    inspect: ::core::concat!(
                        "SELECT state, CAST(max(0, (julianday(expires_at) - julianday('now')) \
                         * 86400000000.0) AS INTEGER) FROM ", $table,
                        " WHERE consumer = ?1 AND message_id = ?2"
                    ),
                    extend: ::core::concat!(
                        "UPDATE ", $table,
                        " SET expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                         printf('%+.6f seconds', ?4 / 1000000.0)) \
                         WHERE consumer = ?1 AND message_id = ?2 AND owner = ?3 AND state IS NOT NULL"
                    ),
                    release: ::core::concat!(
                        "DELETE FROM ", $table,
                        " WHERE consumer = ?1 AND message_id = ?2 AND owner = ?3 AND state IS NOT NULL"
                    ),
                    complete: ::core::concat!(
                        "UPDATE ", $table,
                        " SET state = NULL, expires_at = NULL, \
                         processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                         WHERE consumer = ?1 AND message_id = ?2 AND owner = ?3 AND state IS NOT NULL"
                    ),
                    check: "",
                    claim_printed: ::core::concat!(
                        "INSERT INTO ", $table,
                        " (consumer, message_id, state, owner, expires_at, fingerprint) \
                         VALUES (?1, ?2, ?3, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                         printf('%+.6f seconds', ?5 / 1000000.0)), ?6) ON CONFLICT DO NOTHING"
                    ),
                    take_over_printed: ::core::concat!(
                        "UPDATE ", $table,
                        " SET owner = ?4, state = ?3, \
                         processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
                         expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                         printf('%+.6f seconds', ?5 / 1000000.0)), fingerprint = ?6 \
                         WHERE consumer = ?1 AND message_id = ?2 AND state = 1 \
                         AND expires_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                         AND (fingerprint IS NULL OR fingerprint = ?6)"
                    ),
                    recall: ::core::concat!(
                        "SELECT result, result_version, fingerprint FROM ", $table,
                        " WHERE consumer = ?1 AND message_id = ?2"
                    ),
                    remember: ::core::concat!(
                        "UPDATE ", $table,
                        " SET result = ?4, result_version = ?5 \
                         WHERE consumer = ?1 AND message_id = ?2 AND owner = ?3"
                    ),
                },
                mysql: $crate::__private::LeaseSql {
                    claim: ::core::concat!(
                        "INSERT INTO ", $table,
                        " (consumer, message_id, processed_at, state, owner, expires_at) \
                         VALUES (?, ?, UTC_TIMESTAMP(6), ?, ?, \
                         UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
                    ),
                    take_over: ::core::concat!(
                        "UPDATE ", $table,
                        " SET owner = ?, state = ?, processed_at = UTC_TIMESTAMP(6), \
                         expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                         WHERE consumer = ? AND message_id = ? AND state = 1 \
                         AND expires_at <= UTC_TIMESTAMP(6)"
                    ),
                    inspect: ::core::concat!(
                        "SELECT state, GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), \
                         expires_at)) FROM ", $table,
                        " WHERE consumer = ? AND message_id = ?"
                    ),
                    extend: ::core::concat!(
                        "UPDATE ", $table,
                        " SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                         WHERE consumer = ? AND message_id = ? AND owner = ? AND state IS NOT NULL"
                    ),
                    release: ::core::concat!(
                        "DELETE FROM ", $table,
                        " WHERE consumer = ? AND message_id = ? AND owner = ? AND state IS NOT NULL"
                    ),
                    complete: ::core::concat!(
                        "UPDATE ", $table,
                        " SET state = NULL, expires_at = NULL, processed_at = UTC_TIMESTAMP(6) \
                         WHERE consumer = ? AND message_id = ? AND owner = ? AND state IS NOT NULL"
                    ),
                    check: ::core::concat!(
                        "SELECT (SELECT 1 UNION ALL SELECT 1 FROM DUAL WHERE NOT EXISTS \
                         (SELECT 1 FROM ", $table,
                        " WHERE consumer = ? AND message_id = ? AND owner = ? AND state IS NULL))"
                    ),
                    claim_printed: ::core::concat!(
                        "INSERT INTO ", $table,
                        " (consumer, message_id, processed_at, state, owner, expires_at, fingerprint) \
                         VALUES (?, ?, UTC_TIMESTAMP(6), ?, ?, \
                         UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)"
                    ),
                    // The fingerprint twice: MySQL's parameters are positional.
                    take_over_printed: ::core::concat!(
                        "UPDATE ", $table,
                        " SET owner = ?, state = ?, processed_at = UTC_TIMESTAMP(6), \
                         expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, fingerprint = ? \
                         WHERE consumer = ? AND message_id = ? AND state = 1 \
                         AND expires_at <= UTC_TIMESTAMP(6) \
                         AND (fingerprint IS NULL OR fingerprint = ?)"
                    ),
                    recall: ::core::concat!(
                        "SELECT result, result_version, fingerprint FROM ", $table,
                        " WHERE consumer = ? AND message_id = ?"
                    ),
                    remember: ::core::concat!(
                        "UPDATE ", $table,
                        " SET result = ?, result_version = ? \
                         WHERE consumer = ? AND message_id = ? AND owner = ?"
                    ),
                },
            };
        STATEMENTS
    }};
}
