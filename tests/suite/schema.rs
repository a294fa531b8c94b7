//! The SQL files shipped for users' own migration tools: `0001` is the 0.1 table exactly as
//! 0.1 shipped it (users may have applied it: it never changes), `0002` is exactly the
//! upgrade `upgrade_sql` prints up to 0.2, `0005` the rest (0.2 to 0.3: stored results and
//! fingerprints), and `schema_sql` creates the complete current table; `0003` and `0004`
//! are the inbox's and the outbox's tables.
//! After changing the upgrade's DDL, regenerate `0002` and `0005` with
//! `DEDUP_BLESS=1 cargo test --test schema`.

use std::path::{Path, PathBuf};

use dedup_suite::schema_0_1;

fn path(backend: &str, file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("dedup-runtime/migrations")
        .join(backend)
        .join(file)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

const HEADER_0001: &str = "-- The dedup table of dedup-runtime: what `dedup_runtime::migrate` creates.\n\
                           -- Copy it into your own migrations; it is safe to run more than once.\n\n";

/// The header of each backend's `0002`: what it does, and whether it may run twice.
fn header_0002(backend: &str) -> &'static str {
    match backend {
        "postgres" => {
            "-- Migration 0002: upgrades the dedup table of 0001_processed_messages.sql with the\n\
             -- columns state, owner, expires_at (NULL for every existing row: processed) and an\n\
             -- index of the rows not processed. What `dedup_runtime::migrate` does to a table\n\
             -- without them. Safe to run more than once. Consumers wait while it runs: it checks the new\n\
             -- CHECK and builds the partial index with one scan of the table each.\n\n"
        }
        "mysql" => {
            "-- Migration 0002: upgrades the dedup table of 0001_processed_messages.sql with the\n\
             -- columns state, owner, expires_at (NULL for every existing row: processed). What\n\
             -- `dedup_runtime::migrate` does to a table without them; no index (MySQL has no partial index,\n\
             -- and every claim would pay for a full one). MariaDB: safe to run more than once; on\n\
             -- 10.11 the ALTER is ALGORITHM=INSTANT. MySQL 8 has no ADD COLUMN IF NOT EXISTS:\n\
             -- delete the three `IF NOT EXISTS` and run it once (as migration tools do).\n\n"
        }
        "sqlite" => {
            "-- Migration 0002: upgrades the dedup table of 0001_processed_messages.sql with the\n\
             -- columns state, owner, expires_at (NULL for every existing row: processed) and an\n\
             -- index of the rows not processed. What `dedup_runtime::migrate` does to a table\n\
             -- without them. SQLite has no ADD COLUMN IF NOT EXISTS: run it once (as migration tools do).\n\n"
        }
        other => panic!("no backend {other}"),
    }
}

fn check(backend: &str, file: &str, expected: &str, bless: bool) {
    let path = path(backend, file);
    if bless && std::env::var_os("DEDUP_BLESS").is_some() {
        std::fs::write(&path, expected).unwrap();
    }
    assert_eq!(
        read(&path),
        expected,
        "{} is stale{}",
        path.display(),
        if bless {
            ": run with DEDUP_BLESS=1"
        } else {
            " (migration 0001's file: never change it)"
        }
    );
}

#[test]
fn shipped_0001_is_the_frozen_0_1_table() {
    for (backend, ddl) in [
        ("postgres", schema_0_1::postgres("processed_messages")),
        ("mysql", schema_0_1::mysql("processed_messages")),
        ("sqlite", schema_0_1::sqlite("processed_messages")),
    ] {
        let expected = format!("{HEADER_0001}{ddl}");
        check(backend, "0001_processed_messages.sql", &expected, false);
    }
}

/// The header of each backend's `0005`.
fn header_0005(backend: &str) -> &'static str {
    match backend {
        "postgres" => {
            "-- Migration 0005: upgrades the dedup table of 0002_processed_messages_state.sql with\n\
             -- the columns result, result_version, fingerprint (NULL for every existing row),\n\
             -- what a row remembers for `result = \"stored\"` and `fingerprint = …`. What\n\
             -- `dedup_runtime::migrate` does to a table without them. Safe to run more than once; a\n\
             -- catalog change (nullable, no default: no row is rewritten).\n\n"
        }
        "mysql" => {
            "-- Migration 0005: upgrades the dedup table of 0002_processed_messages_state.sql with\n\
             -- the columns result, result_version, fingerprint (NULL for every existing row),\n\
             -- what a row remembers for `result = \"stored\"` and `fingerprint = …`. What\n\
             -- `dedup_runtime::migrate` does to a table without them. MariaDB: safe to run more than once;\n\
             -- on 10.11 the ALTER is ALGORITHM=INSTANT. MySQL 8 has no ADD COLUMN IF NOT EXISTS:\n\
             -- delete the three `IF NOT EXISTS` and run it once (as migration tools do).\n\n"
        }
        "sqlite" => {
            "-- Migration 0005: upgrades the dedup table of 0002_processed_messages_state.sql with\n\
             -- the columns result, result_version, fingerprint (NULL for every existing row),\n\
             -- what a row remembers for `result = \"stored\"` and `fingerprint = …`. What\n\
             -- `dedup_runtime::migrate` does to a table without them. SQLite has no ADD COLUMN IF NOT\n\
             -- EXISTS: run it once (as migration tools do).\n\n"
        }
        other => panic!("no backend {other}"),
    }
}

/// `upgrade_sql`, split where 0.3's statements start: `0002`'s part and `0005`'s.
fn upgrade_parts(sql: &str) -> (String, String) {
    let statements: Vec<String> = sql.split_inclusive(";\n").map(str::to_owned).collect();
    let at = statements
        .iter()
        .position(|statement| statement.contains("result"))
        .expect("the upgrade adds the result columns");
    (statements[..at].concat(), statements[at..].concat())
}

fn upgrades() -> [(&'static str, String); 3] {
    [
        (
            "postgres",
            dedup_runtime::upgrade_sql::<sqlx::Postgres>("processed_messages").unwrap(),
        ),
        (
            "mysql",
            dedup_runtime::upgrade_sql::<sqlx::MySql>("processed_messages").unwrap(),
        ),
        (
            "sqlite",
            dedup_runtime::upgrade_sql::<sqlx::Sqlite>("processed_messages").unwrap(),
        ),
    ]
}

/// `0002` then `0005` are exactly the upgrade `upgrade_sql` prints, in two steps.
#[test]
fn shipped_0002_and_0005_match_upgrade_sql() {
    for (backend, sql) in upgrades() {
        let (state, results) = upgrade_parts(&sql);
        let expected = format!("{}{state}", header_0002(backend));
        check(
            backend,
            "0002_processed_messages_state.sql",
            &expected,
            true,
        );
        let expected = format!("{}{results}", header_0005(backend));
        check(
            backend,
            "0005_processed_messages_results.sql",
            &expected,
            true,
        );
    }
}

/// `schema_sql` creates the whole current table in one go: the 0.1 columns and the new.
#[test]
fn schema_sql_creates_the_current_table() {
    for sql in [
        dedup_runtime::schema_sql::<sqlx::Postgres>("processed_messages").unwrap(),
        dedup_runtime::schema_sql::<sqlx::MySql>("processed_messages").unwrap(),
        dedup_runtime::schema_sql::<sqlx::Sqlite>("processed_messages").unwrap(),
    ] {
        assert!(sql.starts_with("CREATE TABLE IF NOT EXISTS processed_messages ("));
        for column in [
            "consumer ",
            "message_id ",
            "processed_at ",
            "state ",
            "owner ",
            "expires_at ",
            "result ",
            "result_version ",
            "fingerprint ",
        ] {
            assert!(sql.contains(&format!("\n    {column}")), "{column}: {sql}");
        }
    }
    let postgres = dedup_runtime::schema_sql::<sqlx::Postgres>("processed_messages").unwrap();
    assert!(postgres.contains("WHERE state IS NOT NULL"));
    let sqlite = dedup_runtime::schema_sql::<sqlx::Sqlite>("processed_messages").unwrap();
    assert!(sqlite.contains("WHERE state IS NOT NULL"));
    let mysql = dedup_runtime::schema_sql::<sqlx::MySql>("processed_messages").unwrap();
    assert!(
        !mysql.contains("state IS NOT NULL"),
        "no index of state on MySQL"
    );
}

#[test]
fn schema_sql_refuses_bad_names() {
    for bad in [
        "",
        "a b",
        "x;drop",
        "1abc",
        "a.b.c",
        "\"quoted\"",
        &"n".repeat(64),
    ] {
        assert!(
            dedup_runtime::schema_sql::<sqlx::Postgres>(bad).is_err(),
            "{bad:?}"
        );
        assert!(
            dedup_runtime::upgrade_sql::<sqlx::Postgres>(bad).is_err(),
            "{bad:?}"
        );
    }
    let qualified = dedup_runtime::schema_sql::<sqlx::Postgres>("audit.processed").unwrap();
    assert!(qualified.contains("CREATE TABLE IF NOT EXISTS audit.processed ("));
    assert!(
        qualified
            .contains("CREATE INDEX IF NOT EXISTS processed_processed_at_idx ON audit.processed")
    );
    let upgrade = dedup_runtime::upgrade_sql::<sqlx::Postgres>("audit.processed").unwrap();
    assert!(upgrade.starts_with("ALTER TABLE audit.processed\n"));
    assert!(
        upgrade.contains("CREATE INDEX IF NOT EXISTS processed_unresolved_idx ON audit.processed")
    );
}

const HEADER_0003: &str = "-- The inbox table of dedup-runtime (migration 0003): what `dedup_runtime::inbox::migrate`\n\
                           -- creates. Copy it into your own migrations; it is safe to run more than once.\n\n";

#[test]
fn shipped_0003_matches_the_inbox_schema_sql() {
    use dedup_runtime::inbox::schema_sql;
    for (backend, sql) in [
        (
            "postgres",
            schema_sql::<sqlx::Postgres>("inbox_messages").unwrap(),
        ),
        (
            "mysql",
            schema_sql::<sqlx::MySql>("inbox_messages").unwrap(),
        ),
        (
            "sqlite",
            schema_sql::<sqlx::Sqlite>("inbox_messages").unwrap(),
        ),
    ] {
        assert!(
            sql.starts_with("CREATE TABLE IF NOT EXISTS inbox_messages ("),
            "{sql}"
        );
        let expected = format!("{HEADER_0003}{sql}");
        check(backend, "0003_inbox_messages.sql", &expected, true);
    }
}

const HEADER_0004: &str = "-- The outbox table of dedup-runtime (migration 0004): what `dedup_runtime::outbox::migrate`\n\
                           -- creates. Copy it into your own migrations; it is safe to run more than once.\n\n";

#[test]
fn shipped_0004_matches_the_outbox_schema_sql() {
    use dedup_runtime::outbox::schema_sql;
    for (backend, sql) in [
        (
            "postgres",
            schema_sql::<sqlx::Postgres>("outbox_messages").unwrap(),
        ),
        (
            "mysql",
            schema_sql::<sqlx::MySql>("outbox_messages").unwrap(),
        ),
        (
            "sqlite",
            schema_sql::<sqlx::Sqlite>("outbox_messages").unwrap(),
        ),
    ] {
        assert!(
            sql.starts_with("CREATE TABLE IF NOT EXISTS outbox_messages ("),
            "{sql}"
        );
        let expected = format!("{HEADER_0004}{sql}");
        check(backend, "0004_outbox_messages.sql", &expected, true);
    }
}
