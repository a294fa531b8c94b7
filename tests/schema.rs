//! The SQL files shipped for users' own migration tools are exactly what `migrate` runs.
//! After changing the DDL, regenerate them with `DEDUP_BLESS=1 cargo test --test schema`.

use std::path::Path;

fn check(backend: &str, generated: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("dedup-runtime/migrations")
        .join(backend)
        .join("0001_processed_messages.sql");
    let header = "-- The dedup table of dedup-runtime: what `dedup_runtime::migrate` creates.\n\
                  -- Copy it into your own migrations; it is safe to run more than once.\n\n";
    let expected = format!("{header}{generated}");
    if std::env::var_os("DEDUP_BLESS").is_some() {
        std::fs::write(&path, &expected).unwrap();
    }
    let shipped = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    assert_eq!(
        shipped,
        expected,
        "{} is stale: run with DEDUP_BLESS=1",
        path.display()
    );
}

#[test]
fn shipped_sql_matches_migrate() {
    check(
        "postgres",
        &dedup_runtime::schema_sql::<sqlx::Postgres>("processed_messages").unwrap(),
    );
    check(
        "mysql",
        &dedup_runtime::schema_sql::<sqlx::MySql>("processed_messages").unwrap(),
    );
    check(
        "sqlite",
        &dedup_runtime::schema_sql::<sqlx::Sqlite>("processed_messages").unwrap(),
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
    }
    let qualified = dedup_runtime::schema_sql::<sqlx::Postgres>("audit.processed").unwrap();
    assert!(qualified.contains("CREATE TABLE IF NOT EXISTS audit.processed ("));
    assert!(
        qualified
            .contains("CREATE INDEX IF NOT EXISTS processed_processed_at_idx ON audit.processed")
    );
}
