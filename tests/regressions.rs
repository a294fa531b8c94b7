//! Regression fixtures: one module per fixed bug, named after it, each with a comment that
//! says what broke. They run against the real servers (PostgreSQL, MariaDB) and temporary
//! SQLite files, like the rest of the suite.

#[path = "regressions/postgres_swallowed_error.rs"]
mod postgres_swallowed_error;

#[path = "regressions/sqlite_automatic_rollback.rs"]
mod sqlite_automatic_rollback;

#[path = "regressions/mysql_swallowed_deadlock.rs"]
mod mysql_swallowed_deadlock;

#[path = "regressions/lent_connection_left_in_transaction.rs"]
mod lent_connection_left_in_transaction;

#[path = "regressions/mysql_claim_time_zone.rs"]
mod mysql_claim_time_zone;

#[path = "regressions/processed_at_is_the_commit_time.rs"]
mod processed_at_is_the_commit_time;

#[path = "regressions/prune_mysql_time_zone.rs"]
mod prune_mysql_time_zone;

#[path = "regressions/prune_postgres_datestyle.rs"]
mod prune_postgres_datestyle;

#[path = "regressions/ack_idle_in_transaction.rs"]
mod ack_idle_in_transaction;

#[path = "regressions/mysql_business_key_other_table.rs"]
mod mysql_business_key_other_table;

#[path = "regressions/same_id_integer_and_string.rs"]
mod same_id_integer_and_string;
