//! The hosted consumers against the real brokers and the three databases: what each one
//! decides and tells its broker (settle after commit, retry, dead letter, shutdown,
//! reconnection), checked in the database (effects and dedup rows) and in what the broker
//! holds afterwards (feature `brokers`).

mod common;
mod headers;
mod kafka;
mod kafka_crash;
mod kafka_members;
mod kafka_outage;
mod metrics;
mod mqtt;
mod mqtt_crash;
mod nats;
mod nats_crash;
mod rabbitmq;
mod rabbitmq_crash;
mod redis;
mod redis_crash;
mod trace;
mod two_hop;
