//! Every public future a service runs in a task of its own, and every public type it moves
//! into one, can be spawned on a multi-threaded runtime: `Send + 'static`, its output too,
//! given owned arguments (issue 39, item 5: the prunes could not be, and no test spawned
//! one). On every backend, with the concrete types a service names, and once for
//! any backend (`generic`), as code generic over `Backend` names them.
//!
//! The checks are `spawnable(async move { … })`: a future built and dropped unpolled, so
//! the type check is the test, on lazy pools that never connect. The prunes, a worker
//! and a relay then run in tasks of their own against the real servers
//! (`prunes_workers_and_relays_run_in_tasks`). The broker clients' futures (feature
//! `brokers`) are checked in functions that are compiled and never called: their
//! arguments are live deliveries and connections.

use std::future::Future;
use std::time::Duration;

use dedup_runtime::batch::{Batch, BatchHandler};
use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};
use dedup_runtime::{
    AckPolicy, Backend, Lease, Ledger, Prune, PruneProgress, Resolution, idempotent,
};

/// What `tokio::spawn` asks of a future; returns it, unpolled.
fn spawnable<F>(future: F) -> F
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    future
}

/// What a service asks of a handle it moves into a task, or shares between tasks behind
/// an `Arc`.
fn movable<T: Send + Sync + 'static>() {}

/// `spawnable(async move { body })`, the future owning its own clones of `names`, as a
/// task gets them.
macro_rules! check {
    ([$($name:ident),*] $body:block) => {{
        $(let $name = $name.clone();)*
        drop(spawnable(async move $body));
    }};
}

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// A week of ids kept, for a broker that redelivers for up to 4 days.
fn weekly() -> Prune {
    Prune::new(7 * DAY, 4 * DAY)
}

/// A shutdown signal a task owns (one that never comes: the checks never poll).
fn shutdown() -> impl Future<Output = ()> + Send + 'static {
    std::future::pending()
}

/// A message, as a service's consumer decodes it.
#[derive(Debug, Clone)]
struct Msg {
    id: String,
}

fn msg() -> Msg {
    Msg { id: "m".to_owned() }
}

/// The inbox's and the batch API's handler, on every backend.
struct Handler;

/// The relay's publisher: sends nowhere.
struct Discard;

impl Publisher for Discard {
    type Error = String;

    async fn publish(&self, _: &OutboxMessage) -> Result<(), String> {
        Ok(())
    }
}

/// The handles a service builds once and moves into its tasks, on any backend.
fn handles<DB: Backend>() {
    movable::<Prune>();
    movable::<PruneProgress>();
    movable::<Inbox<DB>>();
    movable::<dedup_runtime::inbox::Worker<DB>>();
    movable::<Outbox>();
    movable::<dedup_runtime::outbox::Relay<DB>>();
    movable::<Ledger<DB>>();
    movable::<AckPolicy<DB>>();
    movable::<Batch>();
    movable::<dedup_runtime::IdempotencyKey>();
    movable::<dedup_runtime::Table>();
    movable::<dedup_runtime::PruneError>();
    movable::<dedup_runtime::LedgerError>();
    movable::<dedup_runtime::inbox::InboxError>();
    movable::<dedup_runtime::outbox::OutboxError>();
    movable::<dedup_runtime::operate::DeadLetters>();
    movable::<dedup_runtime::operate::Filter>();
    movable::<dedup_runtime::operate::RedeliveryWindow>();
    movable::<dedup_runtime::operate::OperateError>();
}

/// The futures that take no handler, in code generic over the backend.
fn generic<DB: Backend>(pool: sqlx::Pool<DB>) {
    handles::<DB>();
    check!([pool] { weekly().run(&pool, |_| {}).await });
    check!([pool] { weekly().stats(&pool).await });
    let inbox = Inbox::new(&pool, "spawnable").unwrap();
    check!([inbox] { weekly().run_inbox(&inbox, |_| {}).await });
    check!([inbox] { inbox.prune(7 * DAY, 4 * DAY).await });
    check!([inbox] { inbox.receive(Incoming::new("m", b"p")).await });
    check!([inbox] { inbox.stats().await });
    let outbox = Outbox::new();
    check!([outbox, pool] { weekly().run_outbox(&outbox, &pool, |_| {}).await });
    check!([outbox, pool] { outbox.stats(&pool).await });
    let relay = outbox.relay(&pool);
    drop(spawnable(
        async move { relay.run(&Discard, shutdown()).await },
    ));
    let ledger = Ledger::new(&pool);
    check!([ledger] { ledger.processed_at("spawnable", "m").await });
    check!([pool] { dedup_runtime::migrate(&pool).await });
    operate::<DB>(pool);
}

/// The operator's calls on dead rows, each on a pooled connection the task owns.
fn operate<DB: Backend>(pool: sqlx::Pool<DB>) {
    use dedup_runtime::operate::{DeadLetters, Filter, RedeliveryWindow};
    let dead = DeadLetters::inbox("inbox_messages").unwrap();
    let filter = Filter::new()
        .consumer("spawnable")
        .error_contains("timeout");
    let window = RedeliveryWindow::new(7 * DAY).consumer("spawnable", DAY);
    check!([pool, dead] {
        let mut conn = pool.acquire().await.unwrap();
        dead.summary::<DB>(&mut conn).await
    });
    check!([pool, dead, filter] {
        let mut conn = pool.acquire().await.unwrap();
        dead.list::<DB>(&mut conn, &filter, None, 10).await
    });
    check!([pool, dead, filter] {
        let mut conn = pool.acquire().await.unwrap();
        dead.count::<DB>(&mut conn, &filter).await
    });
    check!([pool, dead, filter, window] {
        let mut conn = pool.acquire().await.unwrap();
        dead.requeue::<DB>(&mut conn, &filter, &window).await
    });
    check!([pool, dead, filter] {
        let mut conn = pool.acquire().await.unwrap();
        dead.discard::<DB>(&mut conn, &filter).await
    });
}

macro_rules! backend {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        lazy = $lazy:expr,
        pool = $pool:expr $(,)?
    ) => {
        mod $backend {
            use super::*;

            type Pool = sqlx::Pool<$db>;

            #[idempotent(consumer = "spawnable-plain", key = msg.id)]
            async fn plain(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "spawnable-unique", key = msg.id, unique = "spawnable_key")]
            async fn unique(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "spawnable-batch", batch = msgs, key = |msg| msg.id.as_str())]
            async fn batch(tx: &mut $conn, msgs: &[&Msg]) -> Result<(), sqlx::Error> {
                for _ in msgs {
                    sqlx::query("SELECT 1").execute(&mut *tx).await?;
                }
                Ok(())
            }

            #[idempotent(consumer = "spawnable-send-first", key = msg.id, effect = "send-first")]
            async fn send_first(tx: &mut $conn, msg: &Msg) -> Result<usize, sqlx::Error> {
                Ok(msg.id.len())
            }

            #[idempotent(
                consumer = "spawnable-leased",
                key = msg.id,
                effect = "send-first",
                lease = "30s"
            )]
            async fn leased(lease: &mut Lease<'_, $db>, msg: &Msg) -> Result<(), sqlx::Error> {
                lease.extend().await?;
                let tx = lease.transaction().await?;
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(
                consumer = "spawnable-mark-first",
                key = msg.id,
                effect = "mark-first",
                lease = "30s"
            )]
            async fn mark_first(lease: &mut Lease<'_, $db>, msg: &Msg) -> Result<(), sqlx::Error> {
                lease.extend().await
            }

            #[idempotent(consumer = "spawnable-stored", key = msg.id, result = "stored")]
            async fn stored(tx: &mut $conn, msg: &Msg) -> Result<u32, sqlx::Error> {
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(7)
            }

            /// A service whose handler is a method, shared by its tasks behind an `Arc`.
            struct Service;

            impl Service {
                #[idempotent(consumer = "spawnable-method", key = msg.id)]
                async fn handle(&self, tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                    sqlx::query("SELECT 1").execute(&mut *tx).await?;
                    Ok(())
                }
            }

            impl InboxHandler<$db> for Handler {
                type Error = sqlx::Error;

                async fn handle(&self, tx: &mut $conn, _: &InboxMessage) -> Result<(), sqlx::Error> {
                    sqlx::query("SELECT 1").execute(&mut *tx).await.map(drop)
                }
            }

            impl BatchHandler<$db, InboxMessage> for Handler {
                type Error = sqlx::Error;

                async fn handle(
                    &self,
                    tx: &mut $conn,
                    _: &[&InboxMessage],
                ) -> Result<(), sqlx::Error> {
                    sqlx::query("SELECT 1").execute(&mut *tx).await.map(drop)
                }
            }

            impl BatchHandler<$db, Msg> for Handler {
                type Error = sqlx::Error;

                async fn handle(&self, tx: &mut $conn, _: &[&Msg]) -> Result<(), sqlx::Error> {
                    sqlx::query("SELECT 1").execute(&mut *tx).await.map(drop)
                }
            }

            /// Every generated handler form, given a pool; the plain one also given a
            /// connection and a transaction of the task's own.
            fn handlers(pool: Pool) {
                check!([pool] { plain(&pool, &msg()).await });
                check!([pool] {
                    let mut conn = pool.acquire().await?;
                    plain(&mut conn, &msg()).await
                });
                check!([pool] {
                    let mut tx = pool.begin().await?;
                    let outcome = plain(&mut tx, &msg()).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(outcome)
                });
                check!([pool] { unique(&pool, &msg()).await });
                check!([pool] { batch(&pool, &[msg(), msg()]).await });
                check!([pool] { send_first(&pool, &msg()).await });
                check!([pool] { leased(&pool, &msg()).await });
                check!([pool] { mark_first(&pool, &msg()).await });
                check!([pool] { stored(&pool, &msg()).await });
                let service = std::sync::Arc::new(Service);
                check!([pool, service] { service.handle(&pool, &msg()).await });
            }

            /// The batch API (`dedup_runtime::batch::Batch`), on a pool and on a
            /// connection, without and with fingerprints.
            fn batches(pool: Pool) {
                let batch = Batch::new("spawnable-batch-api").unwrap();
                check!([pool, batch] {
                    let msgs = vec![msg(), msg()];
                    batch.run(&pool, &msgs, |msg: &Msg| msg.id.as_str(), &Handler).await
                });
                check!([pool, batch] {
                    let msgs = vec![msg()];
                    let mut conn = pool.acquire().await?;
                    batch
                        .run_on::<$db, _, _, _>(&mut conn, &msgs, |msg: &Msg| msg.id.as_str(), &Handler)
                        .await
                });
                let printed = Batch::new("spawnable-batch-printed")
                    .unwrap()
                    .fingerprint(|msg: &Msg| dedup_runtime::fingerprint(&msg.id));
                drop(spawnable(async move {
                    let msgs = vec![msg()];
                    printed.run(&pool, &msgs, |msg: &Msg| msg.id.as_str(), &Handler).await
                }));
            }

            /// The inbox: receiving, its operator's calls, its prune, and its workers.
            fn inbox(pool: Pool) {
                let inbox = Inbox::new(&pool, "spawnable").unwrap();
                check!([inbox] {
                    let (id, payload) = (msg().id, b"payload".to_vec());
                    inbox.receive(Incoming::new(&id, &payload).ordering_key("k")).await
                });
                check!([inbox] {
                    let ids = ["a".to_owned(), "b".to_owned()];
                    let messages: Vec<Incoming<'_>> =
                        ids.iter().map(|id| Incoming::new(id, b"payload")).collect();
                    inbox.receive_batch(&messages).await
                });
                check!([inbox] { inbox.prune(7 * DAY, 4 * DAY).await });
                check!([inbox] { inbox.dead(10).await });
                check!([inbox] { inbox.requeue("m".to_owned()).await });
                check!([inbox] { inbox.discard("m".to_owned()).await });
                check!([inbox] { inbox.backlog(100).await });
                check!([inbox] { inbox.stats().await });

                let worker = inbox.worker().lease(Duration::from_secs(30));
                drop(spawnable(async move { worker.run(&Handler, shutdown()).await }));
                check!([inbox] { inbox.worker().run_batched(&Handler, shutdown()).await });
                check!([inbox] { inbox.worker().process_batch(&Handler).await });
                check!([inbox] { inbox.worker().process_batched(&Handler).await });
                check!([inbox] {
                    let worker = inbox.worker();
                    let claims = worker.claim().await?;
                    worker.renew(&claims).await?;
                    for message in claims.messages() {
                        worker.process(&claims, message, &Handler).await?;
                    }
                    worker.release(&claims).await
                });
            }

            /// The outbox: enqueueing in a transaction, the operator's calls, and the
            /// relay.
            fn outbox(pool: Pool) {
                let outbox = Outbox::new().notify_relay(true);
                check!([pool, outbox] {
                    let cause = Cause::new("spawnable", "m")?;
                    let payload = b"payload".to_vec();
                    let message = cause.outgoing("receipt", "events", &payload)?;
                    let mut tx = pool.begin().await?;
                    outbox.enqueue(&mut *tx, &message).await?;
                    tx.commit().await?;
                    anyhow::Ok(())
                });
                check!([pool, outbox] { outbox.hint(&pool).await });
                check!([pool, outbox] { outbox.stats(&pool).await });
                check!([pool, outbox] { outbox.health(&pool, Duration::from_secs(60)).await });
                check!([pool, outbox] { outbox.dead(&pool, 10).await });
                let id = Cause::new("spawnable", "m").unwrap().nth_id(0);
                check!([pool, outbox] { outbox.requeue(&pool, id).await });
                check!([pool, outbox] { outbox.discard(&pool, id).await });
                check!([pool, outbox] {
                    Prune::new(7 * DAY, 7 * DAY).run_outbox(&outbox, &pool, |_| {}).await
                });

                let (relay, publisher) = (outbox.relay(&pool).lease(Duration::from_secs(30)), Discard);
                drop(spawnable(async move { relay.run(&publisher, shutdown()).await }));
                check!([pool, outbox] { outbox.relay(&pool).relay_batch(&Discard).await });
            }

            /// Every prune, and the dry run.
            fn prunes(pool: Pool) {
                let prune = weekly().consumer("spawnable").batch_size(500);
                check!([pool, prune] {
                    let mut last = None;
                    prune.run(&pool, |progress| last = Some(progress.clone())).await
                });
                check!([pool, prune] { prune.stats(&pool).await });
                let inbox = Inbox::new(&pool, "spawnable").unwrap();
                check!([inbox, prune] { prune.run_inbox(&inbox, |_| {}).await });
                check!([inbox] { inbox.prune(7 * DAY, 4 * DAY).await });
                let outbox = Outbox::new();
                check!([pool, outbox, prune] { prune.run_outbox(&outbox, &pool, |_| {}).await });
            }

            /// The ledger (the operator's view of the dedup table) and the migrations.
            fn ledger_and_migrations(pool: Pool) {
                let ledger = Ledger::new(&pool);
                check!([ledger] { ledger.processed_at("spawnable", "m").await });
                check!([ledger] { ledger.forget("spawnable", "m".to_owned()).await });
                check!([ledger] { ledger.unresolved("spawnable", 10).await });
                check!([ledger] { ledger.resolve("spawnable", "m", Resolution::Done).await });
                check!([pool] { dedup_runtime::migrate(&pool).await });
                check!([pool] { dedup_runtime::migrate_table(&pool, "spawnable_dedup").await });
                check!([pool] { dedup_runtime::inbox::migrate(&pool).await });
                check!([pool] { dedup_runtime::inbox::migrate_table(&pool, "spawnable_inbox").await });
                check!([pool] { dedup_runtime::outbox::migrate(&pool).await });
                check!([pool] { dedup_runtime::outbox::migrate_table(&pool, "spawnable_outbox").await });
                operate::<$db>(pool);
            }

            #[tokio::test]
            async fn every_public_future_is_spawnable() {
                let pool: Pool = $lazy;
                handles::<$db>();
                generic(pool.clone());
                handlers(pool.clone());
                batches(pool.clone());
                inbox(pool.clone());
                outbox(pool.clone());
                prunes(pool.clone());
                ledger_and_migrations(pool);
            }

            /// The prunes, a worker and a relay, each `tokio::spawn`ed and run to its end
            /// on the real server: an inbox and an outbox of the test's own, the dedup
            /// table pruned for a consumer of its own.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn prunes_workers_and_relays_run_in_tasks() {
                let db = $pool;
                let pool: Pool = (*db).clone();
                dedup_runtime::inbox::migrate(&pool).await.unwrap();
                let consumer = dedup_suite::unique("spawnable");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let table = dedup_suite::unique_table("spawnable_outbox");
                dedup_runtime::outbox::migrate_table(&pool, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                inbox.receive(Incoming::new("m", b"payload")).await.unwrap();
                let cause = Cause::new(&consumer, "m").unwrap();
                let mut tx = pool.begin().await.unwrap();
                outbox
                    .enqueue(&mut *tx, &cause.nth_outgoing(0, "events", b"payload"))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();

                let prune = weekly().consumer(&consumer);
                let runs = [
                    {
                        let (prune, pool) = (prune.clone(), pool.clone());
                        tokio::spawn(async move { prune.run(&pool, |_| {}).await })
                    },
                    {
                        let (prune, inbox) = (prune.clone(), inbox.clone());
                        tokio::spawn(async move { prune.run_inbox(&inbox, |_| {}).await })
                    },
                    {
                        let (outbox, pool) = (outbox.clone(), pool.clone());
                        tokio::spawn(async move { prune.run_outbox(&outbox, &pool, |_| {}).await })
                    },
                ];
                let stats = {
                    let (prune, pool) = (weekly().consumer(&consumer), pool.clone());
                    tokio::spawn(async move { prune.stats(&pool).await })
                };
                let inbox_prune = {
                    let inbox = inbox.clone();
                    tokio::spawn(async move { inbox.prune(7 * DAY, 4 * DAY).await })
                };
                for run in runs {
                    let done = run.await.unwrap().unwrap();
                    assert!(done.done, "{done:?}");
                    assert_eq!(done.deleted, 0, "nothing is a week old");
                }
                assert_eq!(stats.await.unwrap().unwrap(), []);
                assert_eq!(inbox_prune.await.unwrap().unwrap(), 0);

                // A worker and a relay, each until its shutdown: once the row it takes
                // is done.
                let processed = {
                    let inbox = inbox.clone();
                    async move {
                        while inbox.stats().await.unwrap().processed == 0 {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                };
                let worker = inbox.worker();
                let worker = tokio::spawn(async move { worker.run(&Handler, processed).await });
                let sent = {
                    let (outbox, pool) = (outbox.clone(), pool.clone());
                    async move {
                        while outbox.stats(&pool).await.unwrap().sent == 0 {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                };
                let relay = outbox.relay(&pool);
                let relay = tokio::spawn(async move { relay.run(&Discard, sent).await });
                let patience = Duration::from_secs(30);
                tokio::time::timeout(patience, worker)
                    .await
                    .expect("the worker processes the message and stops")
                    .unwrap()
                    .unwrap();
                tokio::time::timeout(patience, relay)
                    .await
                    .expect("the relay sends the message and stops")
                    .unwrap()
                    .unwrap();
                assert_eq!(inbox.stats().await.unwrap().processed, 1);
                assert_eq!(outbox.stats(&pool).await.unwrap().sent, 1);
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    lazy = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy(&dedup_suite::postgres_url())
        .unwrap(),
    pool = Box::new(dedup_suite::postgres().await),
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    lazy = sqlx::mysql::MySqlPoolOptions::new()
        .connect_lazy(&dedup_suite::mysql_url())
        .unwrap(),
    pool = Box::new(dedup_suite::mysql().await),
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    lazy = sqlx::sqlite::SqlitePoolOptions::new()
        .connect_lazy("sqlite::memory:")
        .unwrap(),
    pool = dedup_suite::sqlite().await,
);

/// The broker side: settling a delivery, and each publisher's sends and relay, on every
/// backend. Compiled and never called: the arguments are live deliveries, channels and
/// connections, and the type check is the test.
#[cfg(feature = "brokers")]
#[allow(dead_code)]
mod brokers {
    use dedup_runtime::Ack;
    use dedup_runtime::async_nats::JetStreamPublisher;
    use dedup_runtime::lapin::RabbitMqPublisher;
    use dedup_runtime::outbox::Relay;
    use dedup_runtime::rdkafka::KafkaPublisher;
    use dedup_runtime::redis::RedisStreamsPublisher;
    use dedup_runtime::rumqttc::MqttPublisher;

    use super::*;

    /// RabbitMQ: a delivery settled in the task that processed it; the publisher built
    /// in a task.
    fn lapin(delivery: lapin::message::Delivery, uri: String) {
        drop(spawnable(async move {
            dedup_runtime::lapin::settle(&delivery, Ack::Ack).await
        }));
        drop(spawnable(async move {
            let properties = lapin::ConnectionProperties::default();
            RabbitMqPublisher::connect(&uri, properties, "events").await
        }));
    }

    /// NATS JetStream: a message settled, a copy dead-lettered to a subject the task owns.
    fn async_nats(message: async_nats::jetstream::Message) {
        drop(spawnable(async move {
            let subject = String::from("orders.dead");
            dedup_runtime::async_nats::settle(&message, Ack::DeadLetter, Some(&subject)).await
        }));
    }

    /// Each publisher: its sends, and a relay through it on every backend.
    macro_rules! publishers {
        ($($name:ident: $publisher:ty),* $(,)?) => {$(
            fn $name(
                publisher: $publisher,
                message: OutboxMessage,
                messages: Vec<OutboxMessage>,
                postgres: Relay<sqlx::Postgres>,
                mysql: Relay<sqlx::MySql>,
                sqlite: Relay<sqlx::Sqlite>,
            ) {
                movable::<$publisher>();
                let publisher = std::sync::Arc::new(publisher);
                check!([publisher] { publisher.publish(&message).await });
                check!([publisher] { publisher.publish_batch(&messages).await });
                check!([publisher] { postgres.run(&*publisher, shutdown()).await });
                check!([publisher] { mysql.relay_batch(&*publisher).await });
                check!([publisher] { sqlite.run(&*publisher, shutdown()).await });
            }
        )*};
    }

    /// The hosted consumers (RabbitMQ, NATS JetStream, Redis Streams, MQTT): run in a task of its own, with an
    /// `#[idempotent]` handler over its `Message`, on every backend.
    macro_rules! hosted_consumers {
        ($consumer:ty => $($name:ident: $db:ty, $conn:ty;)*) => {$(
            mod $name {
                use std::sync::Arc;

                use dedup_runtime::consume::Message;

                use super::super::spawnable;

                #[dedup_runtime::idempotent(consumer = "spawned", key = msg.id())]
                async fn apply(tx: &mut $conn, msg: &Message) -> Result<(), sqlx::Error> {
                    sqlx::query("SELECT 1").execute(&mut *tx).await?;
                    Ok(())
                }

                pub(super) fn run(consumer: $consumer, pool: sqlx::Pool<$db>) {
                    super::super::movable::<$consumer>();
                    drop(spawnable(async move {
                        let handler = |pool: sqlx::Pool<$db>, msg: Arc<Message>| async move {
                            apply(&pool, &msg).await
                        };
                        consumer.run(&pool, handler, super::super::shutdown()).await
                    }));
                }
            }
        )*};
    }

    hosted_consumers! {
        dedup_runtime::redis::RedisStreamsConsumer =>
        redis_consumer_postgres: sqlx::Postgres, sqlx::PgConnection;
        redis_consumer_mysql: sqlx::MySql, sqlx::MySqlConnection;
        redis_consumer_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    hosted_consumers! {
        dedup_runtime::rumqttc::MqttConsumer =>
        mqtt_consumer_postgres: sqlx::Postgres, sqlx::PgConnection;
        mqtt_consumer_mysql: sqlx::MySql, sqlx::MySqlConnection;
        mqtt_consumer_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    hosted_consumers! {
        dedup_runtime::lapin::RabbitMqConsumer =>
        consumer_postgres: sqlx::Postgres, sqlx::PgConnection;
        consumer_mysql: sqlx::MySql, sqlx::MySqlConnection;
        consumer_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    hosted_consumers! {
        dedup_runtime::async_nats::JetStreamConsumer =>
        jetstream_consumer_postgres: sqlx::Postgres, sqlx::PgConnection;
        jetstream_consumer_mysql: sqlx::MySql, sqlx::MySqlConnection;
        jetstream_consumer_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    hosted_consumers! {
        dedup_runtime::rdkafka::KafkaConsumer =>
        kafka_consumer_postgres: sqlx::Postgres, sqlx::PgConnection;
        kafka_consumer_mysql: sqlx::MySql, sqlx::MySqlConnection;
        kafka_consumer_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    /// Every consumer's batch form (`run_batches`), on every backend.
    macro_rules! batches {
        ($consumer:ty => $($name:ident: $db:ty, $conn:ty;)*) => {$(
            mod $name {
                use std::sync::Arc;

                use dedup_runtime::consume::Message;

                use super::super::spawnable;

                #[dedup_runtime::idempotent(consumer = "spawned", batch = fresh, key = |msg| msg.id())]
                async fn apply(tx: &mut $conn, fresh: &[&Message]) -> Result<(), sqlx::Error> {
                    let _ = fresh;
                    sqlx::query("SELECT 1").execute(&mut *tx).await?;
                    Ok(())
                }

                pub(super) fn run(consumer: $consumer, pool: sqlx::Pool<$db>) {
                    drop(spawnable(async move {
                        let handler = |pool: sqlx::Pool<$db>, batch: Arc<[Message]>| async move {
                            apply(&pool, &batch).await
                        };
                        consumer.run_batches(&pool, 100, handler, super::super::shutdown()).await
                    }));
                }
            }
        )*};
    }

    batches! {
        dedup_runtime::rdkafka::KafkaConsumer =>
        kafka_batches_postgres: sqlx::Postgres, sqlx::PgConnection;
        kafka_batches_mysql: sqlx::MySql, sqlx::MySqlConnection;
        kafka_batches_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    batches! {
        dedup_runtime::lapin::RabbitMqConsumer =>
        rabbitmq_batches_postgres: sqlx::Postgres, sqlx::PgConnection;
        rabbitmq_batches_mysql: sqlx::MySql, sqlx::MySqlConnection;
        rabbitmq_batches_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    batches! {
        dedup_runtime::async_nats::JetStreamConsumer =>
        jetstream_batches_postgres: sqlx::Postgres, sqlx::PgConnection;
        jetstream_batches_mysql: sqlx::MySql, sqlx::MySqlConnection;
        jetstream_batches_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    batches! {
        dedup_runtime::redis::RedisStreamsConsumer =>
        redis_batches_postgres: sqlx::Postgres, sqlx::PgConnection;
        redis_batches_mysql: sqlx::MySql, sqlx::MySqlConnection;
        redis_batches_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    batches! {
        dedup_runtime::rumqttc::MqttConsumer =>
        mqtt_batches_postgres: sqlx::Postgres, sqlx::PgConnection;
        mqtt_batches_mysql: sqlx::MySql, sqlx::MySqlConnection;
        mqtt_batches_sqlite: sqlx::Sqlite, sqlx::SqliteConnection;
    }

    publishers! {
        rabbitmq: RabbitMqPublisher,
        jetstream: JetStreamPublisher,
        kafka: KafkaPublisher,
        redis_streams: RedisStreamsPublisher,
        mqtt: MqttPublisher,
    }
}
