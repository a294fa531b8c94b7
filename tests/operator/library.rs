//! `dedup_runtime::operate` on every backend.

use std::time::Duration;

use dedup_runtime::operate::{DeadLetters, Filter, OperateError, RedeliveryWindow, RowHeaders};
use dedup_runtime::outbox::{Cause, Outbox};

use crate::backends::{Under, backends, exec, receive};

const DAY: Duration = Duration::from_secs(86_400);

async fn states<DB: Under>(pool: &sqlx::Pool<DB>, table: &str, state: i64) -> i64 {
    DB::count(
        pool,
        format!("SELECT COUNT(*) FROM {table} WHERE state = {state}"),
        vec![],
    )
    .await
}

async fn inbox_filters_list_requeue_and_discard<DB: Under>(pool: &sqlx::Pool<DB>) {
    let table = dedup_suite::unique_table("op_inbox");
    dedup_runtime::inbox::migrate_table(pool, &table)
        .await
        .unwrap();
    let billing: Vec<String> = (0..3).map(|n| format!("bill-{n}")).collect();
    let audit: Vec<String> = (0..2).map(|n| format!("audit-{n}")).collect();
    receive(pool, &table, "billing", &billing, br#"{"amount": 5}"#).await;
    receive(
        pool,
        &table,
        "audit",
        &audit,
        b"<script>alert(1)</script>\0\xff",
    )
    .await;
    receive(pool, &table, "quiet", &["q-1".to_owned()], b"fine").await;
    exec(
        pool,
        DB::kill_sql(&table, 1),
        "timeout talking to <b>bank</b>",
        "billing",
    )
    .await;
    exec(pool, DB::kill_sql(&table, 10), "refused: schema", "audit").await;

    let dead = DeadLetters::inbox(&table).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let count = |filter: Filter| {
        let dead = dead.clone();
        let pool = pool.clone();
        async move {
            let mut conn = pool.acquire().await.unwrap();
            dead.count::<DB>(&mut conn, &filter).await.unwrap()
        }
    };
    assert_eq!(
        count(Filter::new()).await,
        5,
        "every dead row, not the pending one"
    );
    assert_eq!(count(Filter::new().consumer("billing")).await, 3);
    assert_eq!(count(Filter::new().error_contains("<b>bank")).await, 3);
    assert_eq!(
        count(Filter::new().error_contains("TIMEOUT")).await,
        0,
        "case-sensitive on every backend (MySQL's collation ignores case)"
    );
    assert_eq!(
        count(Filter::new().error_contains("%")).await,
        0,
        "no wildcards"
    );
    assert_eq!(count(Filter::new().older_than(5 * DAY)).await, 2);
    assert_eq!(
        count(Filter::new().consumer("billing").older_than(5 * DAY)).await,
        0
    );

    let first = dead
        .list::<DB>(&mut conn, &Filter::new(), None, 3)
        .await
        .unwrap();
    assert_eq!(first.len(), 3);
    let rest = dead
        .list::<DB>(&mut conn, &Filter::new(), Some(first[2].row), 3)
        .await
        .unwrap();
    assert_eq!(rest.len(), 2, "the page after the last row");
    let rows: Vec<_> = first.iter().chain(&rest).collect();
    assert!(rows.windows(2).all(|w| w[0].row < w[1].row), "in row order");
    let audit_row = rows.iter().find(|r| r.consumer == "audit").unwrap();
    assert_eq!(
        audit_row.payload, b"<script>alert(1)</script>\0\xff",
        "bytes as stored"
    );
    assert_eq!(audit_row.headers, RowHeaders::Opaque(b"opaque".to_vec()));
    assert_eq!(audit_row.attempts, 5);
    assert_eq!(audit_row.last_error.as_deref(), Some("refused: schema"));
    assert_eq!(audit_row.destination, None);
    assert!(
        audit_row.age > 9 * DAY && audit_row.age < 11 * DAY,
        "{:?}",
        audit_row.age
    );
    assert!(rows.iter().any(|r| r.id == "bill-0"));

    let summary = dead.summary::<DB>(&mut conn).await.unwrap();
    let names: Vec<_> = summary
        .iter()
        .map(|c| (c.consumer.as_str(), c.dead, c.pending))
        .collect();
    assert_eq!(names, [("audit", 2, 0), ("billing", 3, 0), ("quiet", 0, 1)]);
    assert!(summary[2].oldest_pending.is_some());

    // Everything: the billing rows (1 day old) within the window, the audit rows (10 days)
    // past it.
    let acted = dead
        .requeue::<DB>(&mut conn, &Filter::new(), &RedeliveryWindow::new(7 * DAY))
        .await
        .unwrap();
    assert_eq!((acted.matched, acted.done, acted.refused), (5, 3, 2));
    assert_eq!(
        states(pool, &table, 0).await,
        4,
        "the billing rows and the quiet one"
    );
    assert_eq!(states(pool, &table, 3).await, 2, "the audit rows stay dead");

    // A window of the audit consumer's own lets them through.
    let window = RedeliveryWindow::new(7 * DAY).consumer("audit", 30 * DAY);
    let selected = dead
        .list::<DB>(&mut conn, &Filter::new(), None, 10)
        .await
        .unwrap();
    let one = Filter::new().rows([selected[0].row]);
    let acted = dead.requeue::<DB>(&mut conn, &one, &window).await.unwrap();
    assert_eq!((acted.done, acted.refused), (1, 0));
    let acted = dead
        .discard::<DB>(&mut conn, &Filter::new().consumer("audit"))
        .await
        .unwrap();
    assert_eq!((acted.matched, acted.done), (1, 1));
    assert_eq!(states(pool, &table, 3).await, 0);
    assert_eq!(
        states(pool, &table, 2).await,
        1,
        "discarded: recorded as processed"
    );

    // A payload of 1 MiB with NUL bytes: read whole, or only its first bytes.
    let mut big = vec![b'x'; 1 << 20];
    big[7] = 0;
    receive(pool, &table, "big", &["big-1".to_owned()], &big).await;
    exec(pool, DB::kill_sql(&table, 1), "too big", "big").await;
    let only_big = Filter::new().consumer("big");
    let whole = dead
        .list::<DB>(&mut conn, &only_big, None, 1)
        .await
        .unwrap();
    assert_eq!(
        (whole[0].payload.len(), whole[0].payload_len),
        (1 << 20, 1 << 20)
    );
    assert_eq!(whole[0].payload, big);
    let preview = dead.clone().payload_preview(4_097);
    let cut = preview
        .list::<DB>(&mut conn, &only_big, None, 1)
        .await
        .unwrap();
    assert_eq!((cut[0].payload.len(), cut[0].payload_len), (4_097, 1 << 20));
    assert_eq!(cut[0].payload, big[..4_097]);
    dead.discard::<DB>(&mut conn, &only_big).await.unwrap();

    let too_many = Filter::new().rows(0..1_001);
    assert!(matches!(
        dead.count::<DB>(&mut conn, &too_many).await,
        Err(OperateError::TooManyRows { selected: 1_001 })
    ));
    assert_eq!(
        dead.count::<DB>(&mut conn, &Filter::new().rows(0..1_000))
            .await
            .unwrap(),
        0
    );
    let missing = DeadLetters::inbox("no_such_inbox_table").unwrap();
    assert!(matches!(
        missing.count::<DB>(&mut conn, &Filter::new()).await,
        Err(OperateError::MissingTable { .. })
    ));
}

async fn outbox_rows_with_headers<DB: Under>(pool: &sqlx::Pool<DB>)
where
    DB::Connection: dedup_runtime::outbox::OutboxConnection,
{
    let table = dedup_suite::unique_table("op_outbox");
    dedup_runtime::outbox::migrate_table(pool, &table)
        .await
        .unwrap();
    let outbox = Outbox::new().in_table(&table).unwrap();
    let cause = Cause::new("shipping", "order-1").unwrap();
    let mut ids = Vec::new();
    {
        let mut conn = pool.acquire().await.unwrap();
        for n in 0..3 {
            let message = cause
                .nth_outgoing(n, "shipments", br#"{"order": 1}"#)
                .header("tenant", "acme")
                .header("raw", [0u8, 1, 2]);
            outbox.enqueue(&mut *conn, &message).await.unwrap();
            ids.push(message.id().to_string());
        }
    }
    exec(
        pool,
        DB::kill_sql(&table, 2),
        "broker refused: <script>x</script>",
        "shipping",
    )
    .await;
    let dead = DeadLetters::outbox(&table).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let rows = dead
        .list::<DB>(&mut conn, &Filter::new(), None, 10)
        .await
        .unwrap();
    assert_eq!(rows.iter().map(|r| r.id.clone()).collect::<Vec<_>>(), ids);
    assert_eq!(rows[0].destination.as_deref(), Some("shipments"));
    assert_eq!(rows[0].consumer, "shipping");
    assert_eq!(
        rows[0].headers,
        RowHeaders::Pairs(vec![
            ("tenant".to_owned(), b"acme".to_vec()),
            ("raw".to_owned(), vec![0, 1, 2]),
        ])
    );
    let acted = dead
        .requeue::<DB>(
            &mut conn,
            &Filter::new().rows([rows[0].row]),
            &RedeliveryWindow::new(DAY),
        )
        .await
        .unwrap();
    assert_eq!(
        (acted.done, acted.refused),
        (0, 1),
        "2 days old, a window of 1 day"
    );
    let acted = dead
        .requeue::<DB>(
            &mut conn,
            &Filter::new().rows([rows[0].row]),
            &RedeliveryWindow::new(7 * DAY),
        )
        .await
        .unwrap();
    assert_eq!((acted.done, acted.refused), (1, 0));
    let acted = dead.discard::<DB>(&mut conn, &Filter::new()).await.unwrap();
    assert_eq!(acted.done, 2);
    let stats = outbox.stats(pool).await.unwrap();
    assert_eq!((stats.unsent, stats.sent, stats.dead), (1, 2, 0));
}

macro_rules! library_suite {
    ($backend:ident, $db:ty, $pool:expr, |$url_db:ident| $url:expr) => {
        mod $backend {
            #[tokio::test]
            async fn inbox_filters_list_requeue_and_discard() {
                let db = $pool;
                super::inbox_filters_list_requeue_and_discard::<$db>(&db).await;
            }

            #[tokio::test]
            async fn outbox_rows_with_headers() {
                let db = $pool;
                super::outbox_rows_with_headers::<$db>(&db).await;
            }
        }
    };
}

backends!(library_suite);

/// MariaDB with `sql_mode = ''` (no strict mode): the same calls, the same answers.
mod mariadb_lenient {
    #[tokio::test]
    async fn inbox_filters_list_requeue_and_discard() {
        let pool = dedup_suite::mysql_lenient().await;
        super::inbox_filters_list_requeue_and_discard::<sqlx::MySql>(&pool).await;
    }

    #[tokio::test]
    async fn outbox_rows_with_headers() {
        let pool = dedup_suite::mysql_lenient().await;
        super::outbox_rows_with_headers::<sqlx::MySql>(&pool).await;
    }
}
