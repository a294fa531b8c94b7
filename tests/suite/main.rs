//! The plain suites, one module per concern, in one test binary: one link and one
//! monomorphisation of sqlx for all of them instead of one per file (the CI's cold build
//! time), and their tests share the binary's threads as the tests of one file always have.
//! Each module keeps the tables and consumers of its own, so that they can run side by
//! side; the largest (`inbox`, `outbox`, `effects`) are folders, one submodule per concern.
//! The suites that need a broker or the HTTP stack, the crash harnesses and the
//! regression fixtures are binaries of their own (`tests/*.rs`); `spawnable` only compiles
//! the broker clients' futures, behind the feature `brokers`, and runs none.

mod accepted;
mod batch;
mod business_keys;
mod claim_with_begin;
mod consumer_constant;
mod consumers;
mod core;
mod effects;
mod failures;
mod fingerprints;
#[cfg(feature = "http")]
mod http_keys;
mod idempotency_keys;
mod inbox;
mod inbox_batched;
mod metrics;
mod observability;
mod operator;
mod outbox;
mod outbox_trace;
mod prune;
mod public_api;
mod results;
mod schema;
mod spawnable;
mod tables;
mod unresolved;
mod upgrade;
