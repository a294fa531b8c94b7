//! The operator's side on every backend: the library's `dedup_runtime::operate` calls, the
//! `dedup` command (run in process, as `dedup_cli::run`), and the console's JSON API over a
//! real HTTP server and client — stats, dead rows with their payloads, requeue and discard
//! of a selection and of everything a filter matches (10,000 rows), an action retried with
//! its request id, a requeue refused past the redelivery window, unknown outcomes listed
//! and resolved, read-only mode, the token, and stored text that is not ours.

mod api;
mod backends;
mod browser;
mod cli;
mod library;
