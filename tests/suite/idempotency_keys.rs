//! `IdempotencyKey`: the format is a promise to every provider that stored a key, so its
//! values are pinned here, and may never change between versions.

use dedup_runtime::{IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN, idempotent};
use sqlx::SqliteConnection;

/// (scope, id, key): short ids, `:` in the id and in the scope, non-ASCII, spaces,
/// percent signs, controls, integers.
const PINNED: &[(&str, &str, &str)] = &[
    ("email", "evt_91c2", "email:evt_91c2"),
    ("charge", "ch_1", "charge:ch_1"),
    ("email", "a:b", "email:a:b"),
    ("email", ":", "email::"),
    ("a:b", "c", "a%3Ab:c"),
    ("a", "b:c", "a:b:c"),
    ("email", "évt", "email:%C3%A9vt"),
    ("e-mail ✉", "x", "e-mail%20%E2%9C%89:x"),
    ("email", "a b", "email:a%20b"),
    ("email", "100%", "email:100%25"),
    ("email", "%25", "email:%2525"),
    ("email", "tab\there", "email:tab%09here"),
    ("email", "line\nbreak", "email:line%0Abreak"),
    ("email", "", "email:"),
    ("", "evt", ":evt"),
];

#[test]
fn pinned_values() {
    for &(scope, id, key) in PINNED {
        let made = IdempotencyKey::new(scope, id);
        assert_eq!(made.as_str(), key, "scope {scope:?}, id {id:?}");
        assert_eq!(made.to_string(), key);
        assert!(!made.is_hashed());
    }
}

#[test]
fn integer_and_uuid_ids_are_their_text() {
    assert_eq!(IdempotencyKey::new("charge", 42_u64).as_str(), "charge:42");
    assert_eq!(IdempotencyKey::new("charge", -7_i32).as_str(), "charge:-7");
    let id = uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
    assert_eq!(
        IdempotencyKey::new("charge", id).as_str(),
        "charge:01234567-89ab-cdef-0123-456789abcdef"
    );
    assert_eq!(
        IdempotencyKey::new("charge", String::from("42")),
        IdempotencyKey::new("charge", 42_u8)
    );
}

#[test]
fn at_the_limit_spelled_out_over_it_hashed() {
    // "email:" is 6 bytes: an id of 249 fills the 255 exactly.
    let at = "x".repeat(249);
    let key = IdempotencyKey::new("email", at.as_str());
    assert_eq!(key.as_str().len(), MAX_IDEMPOTENCY_KEY_LEN);
    assert_eq!(key.as_str(), format!("email:{at}"));
    assert!(!key.is_hashed());

    // One byte more: hashed, SHA-256 of the whole escaped key (pinned, computed
    // independently), the scope kept in front.
    let over = "x".repeat(250);
    let key = IdempotencyKey::new("email", over.as_str());
    assert_eq!(
        key.as_str(),
        "email:%sha256:8be72c9fcd812289585d0b6a42b2de28b597a915d480a24cfc5bfb8219d9cd0b"
    );
    assert!(key.is_hashed());

    // Escaping counts: 100 `é` are 200 bytes, 600 escaped.
    let key = IdempotencyKey::new("email", "é".repeat(100).as_str());
    assert_eq!(
        key.as_str(),
        "email:%sha256:f6a744e25442c90ae5b7b54335c7f9a26aeb1fa31e2347e9d27d7f17fdb1e672"
    );

    // A scope too long to keep: the hash alone.
    let key = IdempotencyKey::new("s".repeat(184).as_str(), "x".repeat(80).as_str());
    assert_eq!(
        key.as_str(),
        "%sha256:791f74fdcec90dd56c048eb626b91dcfdba596e0cd1bcafc2e7a903f9d7818e2"
    );
    assert!(key.is_hashed());
}

#[test]
fn never_truncated_into_collisions() {
    // Ids that share a 300-byte prefix get different keys.
    let prefix = "p".repeat(300);
    let a = IdempotencyKey::new("email", format!("{prefix}a").as_str());
    let b = IdempotencyKey::new("email", format!("{prefix}b").as_str());
    assert_ne!(a, b);
    assert!(a.as_str().len() <= MAX_IDEMPOTENCY_KEY_LEN);
    // A plain id that spells a hashed key stays a plain key, and differs from it.
    let hashed = IdempotencyKey::new("email", "x".repeat(250).as_str());
    let lookalike = IdempotencyKey::new("email", &hashed.as_str()["email:".len()..]);
    assert_ne!(hashed, lookalike);
    assert!(!lookalike.is_hashed());
    assert!(lookalike.as_str().starts_with("email:%25sha256:"));
}

#[test]
fn keys_are_header_values() {
    for &(scope, id, _) in PINNED {
        let key = IdempotencyKey::new(scope, id);
        assert!(key.as_str().bytes().all(|b| (b'!'..=b'~').contains(&b)));
    }
}

/// Two effects of one handler get two keys, in one line each, from inside the body.
#[idempotent(consumer = "keys-checkout", key = id)]
async fn checkout(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    for key in [
        IdempotencyKey::new("charge", id),
        IdempotencyKey::new("receipt-email", id),
    ] {
        sqlx::query("INSERT INTO outgoing (idempotency_key) VALUES (?)")
            .bind(key.as_str())
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

#[tokio::test]
async fn two_effects_two_keys_from_a_handler_body() {
    let pool = dedup_suite::sqlite().await;
    sqlx::raw_sql("CREATE TABLE outgoing (idempotency_key TEXT NOT NULL)")
        .execute(&*pool)
        .await
        .unwrap();
    assert!(checkout(&*pool, "evt_91c2").await.unwrap().is_processed());
    assert!(checkout(&*pool, "evt_91c2").await.unwrap().is_duplicate());
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM outgoing ORDER BY idempotency_key")
            .fetch_all(&*pool)
            .await
            .unwrap();
    assert_eq!(keys, ["charge:evt_91c2", "receipt-email:evt_91c2"]);
}
