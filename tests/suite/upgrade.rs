//! Upgrading a dedup table that 0.1 created (`dedup_suite::schema_0_1`, its DDL frozen) to
//! the 0.2 columns `state`, `owner`, `expires_at`, on every backend: `migrate_table`
//! upgrades it in place while a consumer keeps processing messages (no error, no lost or
//! doubled effect), the old ids still read as processed, the columns are there with the
//! right types and NULL in every row, `migrate` again — twice at once — changes nothing,
//! and the upgraded table, one upgraded by the shipped `0002` SQL (`upgrade_sql`) and one
//! created from scratch have the same catalog.
//!
//! Each case runs on PostgreSQL and MariaDB (the machine's servers) and on a temporary
//! SQLite file, instantiated once per backend by `upgrade_suite!`. The live case needs a
//! table name literal for its handler: one fixed table per backend, dropped at its start.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dedup_runtime::{Ledger, idempotent};
use dedup_suite::{TestDatabase, schema_0_1};
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres, Sqlite};

/// What a backend's catalog says about a table, as lines to compare: its columns (name,
/// type, nullability, default, collation, in order), its constraints and its indexes,
/// with the table's own name replaced by `T` (index names contain it).
trait Catalog: TestDatabase {
    fn describe(pool: &Pool<Self>, table: &str) -> impl Future<Output = Vec<String>> + Send;

    /// The frozen 0.1 DDL for `table`.
    fn ddl_0_1(table: &str) -> String;
}

/// The text column of each row `sql` returns, given `table` as its one parameter.
macro_rules! lines {
    ($pool:expr, $sql:expr, $table:expr $(,)?) => {{
        let sql: &str = $sql;
        sqlx::query_scalar::<_, String>(AssertSqlSafe(sql.to_owned()))
            .bind($table)
            .fetch_all($pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }};
}

impl Catalog for Postgres {
    async fn describe(pool: &Pool<Self>, table: &str) -> Vec<String> {
        let mut all = lines!(
            pool,
            "SELECT a.attname || ' ' || format_type(a.atttypid, a.atttypmod) \
             || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE ' NULL' END \
             || coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '') \
             || coalesce(' COLLATE ' || c.collname, '') \
             FROM pg_attribute a \
             LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
             LEFT JOIN pg_collation c ON c.oid = a.attcollation \
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped \
             ORDER BY a.attnum",
            table
        );
        all.extend(lines!(
            pool,
            "SELECT 'constraint ' || replace(conname, $1, 'T') || ' ' \
                 || pg_get_constraintdef(oid) || CASE WHEN convalidated THEN '' \
                 ELSE ' NOT VALID' END \
                 FROM pg_constraint WHERE conrelid = to_regclass($1) ORDER BY 1",
            table,
        ));
        all.extend(lines!(
            pool,
            "SELECT 'index ' || replace(indexdef, $1, 'T') FROM pg_indexes \
                 WHERE tablename = $1 AND schemaname = current_schema() ORDER BY 1",
            table,
        ));
        all
    }

    fn ddl_0_1(table: &str) -> String {
        schema_0_1::postgres(table)
    }
}

impl Catalog for MySql {
    async fn describe(pool: &Pool<Self>, table: &str) -> Vec<String> {
        let mut all = lines!(
            pool,
            "SELECT CAST(CONCAT_WS(' ', column_name, column_type, is_nullable, \
             IFNULL(column_default, '-'), IFNULL(collation_name, '-')) AS CHAR) \
             FROM information_schema.columns \
             WHERE table_schema = DATABASE() AND table_name = ? ORDER BY ordinal_position",
            table
        );
        all.extend(lines!(
            pool,
            "SELECT CAST(CONCAT('constraint ', constraint_name, ' ', check_clause) AS CHAR) \
                 FROM information_schema.check_constraints \
                 WHERE constraint_schema = DATABASE() AND table_name = ? ORDER BY 1",
            table,
        ));
        all.extend(lines!(
            pool,
            "SELECT CAST(CONCAT_WS(' ', 'index', index_name, seq_in_index, column_name, \
                 non_unique) AS CHAR) FROM information_schema.statistics \
                 WHERE table_schema = DATABASE() AND table_name = ? \
                 ORDER BY index_name, seq_in_index",
            table,
        ));
        all
    }

    fn ddl_0_1(table: &str) -> String {
        schema_0_1::mysql(table)
    }
}

impl Catalog for Sqlite {
    async fn describe(pool: &Pool<Self>, table: &str) -> Vec<String> {
        // The `CHECK` lives in the table's `CREATE` text, which `ALTER TABLE` edits in its
        // own way: `check_is_enforced` tests it by behaviour instead.
        let mut all = lines!(
            pool,
            "SELECT name || ' ' || type || ' ' || \"notnull\" || ' ' \
             || coalesce(dflt_value, '-') || ' ' || pk \
             FROM pragma_table_info(?1) ORDER BY cid",
            table
        );
        all.extend(lines!(
            pool,
            "SELECT 'index ' || replace(coalesce(sql, name), ?1, 'T') FROM sqlite_master \
                 WHERE type = 'index' AND tbl_name = ?1 ORDER BY 1",
            table,
        ));
        all
    }

    fn ddl_0_1(table: &str) -> String {
        schema_0_1::sqlite(table)
    }
}

/// Runs `sql` (one or more statements), or panics with it.
async fn exec<DB: TestDatabase>(pool: &Pool<DB>, sql: &str)
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
}

/// Two `migrate_table` calls on `table` at the same moment: both must succeed.
async fn migrate_twice_at_once<DB: TestDatabase>(pool: &Pool<DB>, table: &str) {
    let (first, second) = tokio::join!(
        dedup_runtime::migrate_table(pool, table),
        dedup_runtime::migrate_table(pool, table)
    );
    first.unwrap_or_else(|error| panic!("first migrate of {table}: {error}"));
    second.unwrap_or_else(|error| panic!("second migrate of {table}: {error}"));
}

macro_rules! upgrade_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        db = $db:ty,
        pool = $pool:expr,
        live_table = $live_table:literal,
        effects_ddl = $effects_ddl:literal,
        insert_effect = $insert_effect:literal,
        effects_counts = $effects_counts:literal,
        // Inserts a row (consumer, id, state) with `owner` and `expires_at` set.
        insert_claim = $insert_claim:literal $(,)?
    ) => {
        mod $backend {
            use super::*;

            type Db = $db;

            const EFFECTS: &str = concat!($live_table, "_effects");

            async fn drop_table(pool: &Pool<Db>, table: &str) {
                exec(pool, &format!("DROP TABLE IF EXISTS {table}")).await;
            }

            #[idempotent(consumer = "upgrade-live", key = id, table = $live_table)]
            async fn handle(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query($insert_effect)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            async fn effects(pool: &Pool<Db>) -> (i64, i64) {
                sqlx::query_as($effects_counts)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            async fn count(pool: &Pool<Db>, sql: String) -> i64 {
                <Db as TestDatabase>::count(pool, sql, Vec::new()).await
            }

            /// A 0.1 table with 300 processed ids, upgraded by `migrate_table` twice at
            /// once while a consumer processes fresh messages, each delivered twice.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn upgrades_a_0_1_table_while_a_consumer_runs() {
                const OLD: usize = 300;
                let pool = $pool;
                let table = $live_table;
                let _one_at_a_time = dedup_suite::ddl_lock().await;
                drop_table(&pool, table).await;
                exec(&pool, &<Db as Catalog>::ddl_0_1(table)).await;
                exec(&pool, $effects_ddl).await;
                let old_catalog = <Db as Catalog>::describe(&pool, table).await;
                assert!(
                    !old_catalog.iter().any(|line| line.starts_with("state ")),
                    "{old_catalog:#?}"
                );

                // The 0.1 table at work: old ids processed by the handler.
                for i in 0..OLD {
                    let outcome = handle(&*pool, &format!("old-{i}")).await.unwrap();
                    assert!(outcome.is_processed(), "old-{i}");
                }

                // A consumer keeps going while the table is upgraded under it.
                let stop = Arc::new(AtomicBool::new(false));
                let consumer = tokio::spawn({
                    let pool: Pool<Db> = (*pool).clone();
                    let stop = Arc::clone(&stop);
                    async move {
                        let mut processed = 0usize;
                        while !stop.load(Ordering::SeqCst) || processed < 50 {
                            let id = format!("new-{processed}");
                            let first = handle(&pool, &id).await;
                            assert!(first.unwrap().is_processed(), "{id}");
                            let again = handle(&pool, &id).await;
                            assert!(again.unwrap().is_duplicate(), "{id}");
                            processed += 1;
                        }
                        processed
                    }
                });
                tokio::time::sleep(Duration::from_millis(100)).await;
                migrate_twice_at_once(&*pool, table).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                stop.store(true, Ordering::SeqCst);
                let fresh = consumer.await.expect("the consumer saw no error");
                assert!(fresh >= 50, "{fresh}");

                // Exactly one effect and one dedup row per message.
                let messages = (OLD + fresh) as i64;
                assert_eq!(effects(&pool).await, (messages, messages));
                let rows = count(&pool, format!("SELECT COUNT(*) FROM {table}")).await;
                assert_eq!(rows, messages);

                // Every row, old and new, is processed: the new columns are NULL.
                let set = count(
                    &pool,
                    format!(
                        "SELECT COUNT(*) FROM {table} WHERE state IS NOT NULL \
                         OR owner IS NOT NULL OR expires_at IS NOT NULL"
                    ),
                )
                .await;
                assert_eq!(set, 0);

                // Old ids still read as processed: a redelivery is a duplicate.
                for i in (0..OLD).step_by(7) {
                    let again = handle(&*pool, &format!("old-{i}")).await.unwrap();
                    assert!(again.is_duplicate(), "old-{i}");
                }
                let ledger = Ledger::new(&*pool).in_table(table).unwrap();
                assert!(
                    ledger
                        .processed_at("upgrade-live", "old-0")
                        .await
                        .unwrap()
                        .is_some()
                );
                assert_eq!(effects(&pool).await, (messages, messages));

                // Upgraded: the 0.1 columns first, as they were, then the new ones.
                let upgraded = <Db as Catalog>::describe(&pool, table).await;
                let columns: Vec<&str> = upgraded
                    .iter()
                    .filter(|line| !line.starts_with("index ") && !line.starts_with("constraint "))
                    .map(|line| line.split(' ').next().unwrap())
                    .collect();
                assert_eq!(
                    columns,
                    [
                        "consumer",
                        "message_id",
                        "processed_at",
                        "state",
                        "owner",
                        "expires_at",
                        "result",
                        "result_version",
                        "fingerprint"
                    ],
                    "{upgraded:#?}"
                );
                let old_columns: Vec<&String> = old_catalog
                    .iter()
                    .filter(|line| !line.starts_with("index ") && !line.starts_with("constraint "))
                    .collect();
                for line in old_columns {
                    assert!(upgraded.contains(line), "{line} kept: {upgraded:#?}");
                }

                // `migrate` again, twice at once: nothing changes.
                migrate_twice_at_once(&*pool, table).await;
                dedup_runtime::migrate_table(&*pool, table).await.unwrap();
                assert_eq!(<Db as Catalog>::describe(&pool, table).await, upgraded);
                drop(_one_at_a_time);

                drop_table(&pool, table).await;
                drop_table(&pool, EFFECTS).await;
            }

            /// An upgraded 0.1 table, one upgraded by the shipped `0002` SQL, and one
            /// created from scratch by `migrate_table`: the same catalog.
            #[tokio::test]
            async fn upgraded_and_new_tables_are_the_same() {
                let pool = $pool;
                let _one_at_a_time = dedup_suite::ddl_lock().await;
                let upgraded = dedup_suite::unique_table("upgraded");
                let by_file = dedup_suite::unique_table("upgfile");
                let fresh = dedup_suite::unique_table("upgnew");
                exec(&pool, &<Db as Catalog>::ddl_0_1(&upgraded)).await;
                dedup_runtime::migrate_table(&*pool, &upgraded)
                    .await
                    .unwrap();
                exec(&pool, &<Db as Catalog>::ddl_0_1(&by_file)).await;
                exec(&pool, &dedup_runtime::upgrade_sql::<Db>(&by_file).unwrap()).await;
                dedup_runtime::migrate_table(&*pool, &fresh).await.unwrap();
                // The shipped script for a new table is what `migrate` created.
                let by_script = dedup_suite::unique_table("upgscript");
                exec(&pool, &dedup_runtime::schema_sql::<Db>(&by_script).unwrap()).await;

                let expected = <Db as Catalog>::describe(&pool, &fresh).await;
                assert!(
                    expected
                        .iter()
                        .filter(|line| line.starts_with("index "))
                        .count()
                        >= 2,
                    "{expected:#?}"
                );
                let tables = [&upgraded, &by_file, &by_script];
                for table in tables {
                    let described = <Db as Catalog>::describe(&pool, table).await;
                    let normalised: Vec<String> = described
                        .iter()
                        .map(|line| line.replace(table.as_str(), &fresh))
                        .collect();
                    assert_eq!(normalised, expected, "{table}");
                }
                for table in [&upgraded, &by_file, &fresh, &by_script] {
                    drop_table(&pool, table).await;
                }
            }

            /// The `state` check holds on an upgraded table: 1 and 2 only.
            #[tokio::test]
            async fn check_is_enforced_on_an_upgraded_table() {
                let pool = $pool;
                let table = dedup_suite::unique_table("upgcheck");
                {
                    let _one_at_a_time = dedup_suite::ddl_lock().await;
                    exec(&pool, &<Db as Catalog>::ddl_0_1(&table)).await;
                    dedup_runtime::migrate_table(&*pool, &table).await.unwrap();
                }
                let insert = |id: &'static str, state: i16| {
                    sqlx::query(AssertSqlSafe(format!($insert_claim, t = table)))
                        .bind("c")
                        .bind(id)
                        .bind(state)
                        .bind(vec![7u8; 16])
                        .execute(&*pool)
                };
                insert("one", 1).await.unwrap();
                insert("two", 2).await.unwrap();
                assert!(insert("three", 3).await.is_err(), "state 3 is refused");
                assert!(insert("zero", 0).await.is_err(), "state 0 is refused");
                drop_table(&pool, &table).await;
            }
        }
    };
}

upgrade_suite!(
    postgres,
    conn = sqlx::PgConnection,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    live_table = "upgrade_live_postgres",
    effects_ddl = "DROP TABLE IF EXISTS upgrade_live_postgres_effects; \
                   CREATE TABLE upgrade_live_postgres_effects (message_id text NOT NULL)",
    insert_effect = "INSERT INTO upgrade_live_postgres_effects (message_id) VALUES ($1)",
    effects_counts = "SELECT COUNT(*), COUNT(DISTINCT message_id) \
                      FROM upgrade_live_postgres_effects",
    insert_claim = "INSERT INTO {t} (consumer, message_id, state, owner, expires_at) \
                    VALUES ($1, $2, $3, $4, now() + interval '1 minute')",
);

upgrade_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    live_table = "upgrade_live_mysql",
    effects_ddl = "DROP TABLE IF EXISTS upgrade_live_mysql_effects; \
                   CREATE TABLE upgrade_live_mysql_effects \
                   (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    insert_effect = "INSERT INTO upgrade_live_mysql_effects (message_id) VALUES (?)",
    effects_counts = "SELECT COUNT(*), COUNT(DISTINCT message_id) \
                      FROM upgrade_live_mysql_effects",
    insert_claim = "INSERT INTO {t} (consumer, message_id, state, owner, expires_at) \
                    VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6) + INTERVAL 1 MINUTE)",
);

upgrade_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    live_table = "upgrade_live_sqlite",
    effects_ddl = "DROP TABLE IF EXISTS upgrade_live_sqlite_effects; \
                   CREATE TABLE upgrade_live_sqlite_effects (message_id TEXT NOT NULL)",
    insert_effect = "INSERT INTO upgrade_live_sqlite_effects (message_id) VALUES (?)",
    effects_counts = "SELECT COUNT(*), COUNT(DISTINCT message_id) \
                      FROM upgrade_live_sqlite_effects",
    insert_claim = "INSERT INTO {t} (consumer, message_id, state, owner, expires_at) \
                    VALUES (?1, ?2, ?3, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+1 minute'))",
);

/// MariaDB 10.11 adds the six columns without copying or rebuilding the table: the
/// upgrade's `ALTER`, asked for `ALGORITHM=INSTANT`, is accepted (MariaDB refuses an
/// algorithm it cannot use, error 1846, instead of falling back).
#[tokio::test]
async fn mariadb_upgrade_is_instant() {
    let pool = dedup_suite::mysql().await;
    let table = dedup_suite::unique_table("upginstant");
    {
        let _one_at_a_time = dedup_suite::ddl_lock().await;
        exec(&pool, &schema_0_1::mysql(&table)).await;
    }
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (consumer, message_id) VALUES ('c', 'a'), ('c', 'b')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    // 0.2's `ALTER` and 0.3's (the shipped `0002` and `0005`), each instant.
    let upgrade = dedup_runtime::upgrade_sql::<MySql>(&table).unwrap();
    let alters: Vec<&str> = upgrade
        .split(";\n")
        .map(str::trim)
        .filter(|alter| !alter.is_empty())
        .collect();
    assert_eq!(alters.len(), 2, "{upgrade}");
    for alter in alters {
        assert!(alter.starts_with("ALTER TABLE"), "{upgrade}");
        exec(&pool, &format!("{alter}, ALGORITHM=INSTANT")).await;
    }
    // And the copy `migrate` would make is the same table (its `ALTER` has no
    // `IF NOT EXISTS`, but the same columns).
    let fresh = dedup_suite::unique_table("upginstantnew");
    {
        let _one_at_a_time = dedup_suite::ddl_lock().await;
        dedup_runtime::migrate_table(&pool, &fresh).await.unwrap();
        dedup_runtime::migrate_table(&pool, &table).await.unwrap();
    }
    let normalise = |lines: Vec<String>, name: &str| -> Vec<String> {
        lines.iter().map(|line| line.replace(name, "T")).collect()
    };
    assert_eq!(
        normalise(MySql::describe(&pool, &table).await, &table),
        normalise(MySql::describe(&pool, &fresh).await, &fresh)
    );
    exec(&pool, &format!("DROP TABLE {table}; DROP TABLE {fresh}")).await;
}

/// A qualified 0.1 table (`schema.table`) is upgraded like an unqualified one: the
/// catalog lookups (`to_regclass`, `information_schema`, `pragma_table_info`) and the
/// new index take the schema into account. `qualify` turns the frozen unqualified 0.1 DDL
/// for `base` into the same DDL for `schema.base`.
async fn qualified_upgrade<DB: Catalog>(
    pool: &Pool<DB>,
    schema: &str,
    qualify: impl Fn(&str, &str) -> String,
) where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let base = dedup_suite::unique_table("upgqual");
    let fresh = dedup_suite::unique_table("upgqualnew");
    let qualified = format!("{schema}.{base}");
    let _one_at_a_time = dedup_suite::ddl_lock().await;
    exec(pool, &qualify(&DB::ddl_0_1(&base), &base)).await;
    migrate_twice_at_once(pool, &qualified).await;
    dedup_runtime::migrate_table(pool, &fresh).await.unwrap();
    let normalise = |lines: Vec<String>, name: &str| -> Vec<String> {
        lines.iter().map(|line| line.replace(name, "T")).collect()
    };
    let upgraded = normalise(DB::describe(pool, &base).await, &base);
    assert!(
        upgraded.iter().any(|line| line.starts_with("state ")),
        "{upgraded:#?}"
    );
    assert_eq!(
        upgraded,
        normalise(DB::describe(pool, &fresh).await, &fresh)
    );
    exec(pool, &format!("DROP TABLE {qualified}")).await;
    exec(pool, &format!("DROP TABLE {fresh}")).await;
}

#[tokio::test]
async fn postgres_qualified_table_upgrade() {
    let pool = dedup_suite::postgres().await;
    // `describe` reads `current_schema()`: the table's schema is the public one, named.
    qualified_upgrade(&pool, "public", |ddl, base| {
        ddl.replace(
            &format!("EXISTS {base} ("),
            &format!("EXISTS public.{base} ("),
        )
        .replace(&format!(" ON {base} "), &format!(" ON public.{base} "))
    })
    .await;
}

#[tokio::test]
async fn mysql_qualified_table_upgrade() {
    let pool = dedup_suite::mysql().await;
    qualified_upgrade(&pool, "test", |ddl, base| {
        ddl.replace(
            &format!("EXISTS {base} ("),
            &format!("EXISTS test.{base} ("),
        )
        .replace(
            &format!("ALTER TABLE {base} "),
            &format!("ALTER TABLE test.{base} "),
        )
    })
    .await;
}

#[tokio::test]
async fn sqlite_qualified_table_upgrade() {
    let pool = dedup_suite::sqlite().await;
    qualified_upgrade(&pool, "main", |ddl, base| {
        ddl.replace(
            &format!("EXISTS {base} ("),
            &format!("EXISTS main.{base} ("),
        )
        .replace(
            &format!("EXISTS {base}_processed_at_idx"),
            &format!("EXISTS main.{base}_processed_at_idx"),
        )
    })
    .await;
}
