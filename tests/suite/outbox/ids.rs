//! Outgoing ids: derived from the cause as UUIDv5, pinned by a table of values; bad causes
//! and slots are refused.

use dedup_runtime::InvalidMessageId;
use dedup_runtime::outbox::{Cause, InvalidCause, MAX_NAME_LEN, NAMESPACE, OutgoingId};

/// The outgoing ids of a few causes, as Python's `uuid.uuid5(NAMESPACE, consumer + "\0" +
/// id + "\0" + slot)` computes them: the scheme is the contract with every downstream
/// consumer, and never changes.
#[test]
fn outgoing_ids_are_uuid5_of_the_cause() {
    assert_eq!(
        NAMESPACE,
        uuid::Uuid::new_v5(
            &uuid::Uuid::NAMESPACE_URL,
            b"https://github.com/dedup-rs/dedup/outbox"
        )
    );
    assert_eq!(
        NAMESPACE.to_string(),
        "f05ab860-2a3e-578c-897a-484e8894600b"
    );
    for (consumer, incoming, slot, id) in [
        (
            "billing",
            "evt_91c2",
            "invoice-created",
            "d52783e3-eaa0-5242-b33a-713ba7314074",
        ),
        (
            "billing",
            "evt_91c2",
            "0",
            "7bf0ced6-b86c-5a82-9307-5b3e83081f68",
        ),
        ("billing", "42", "0", "cf283d54-4a74-58d3-9800-bcae0a7f3ed0"),
        (
            "audit",
            "evt_91c2",
            "invoice-created",
            "6bd2b18b-b347-5d9d-b15a-e9999b98e422",
        ),
        (
            "billing",
            "évt",
            "a b",
            "918141a6-4cf8-58b8-a8a7-a8c4602b757a",
        ),
        ("a", "b", "c", "650a349e-1748-5269-a350-c138a283c8a8"),
    ] {
        let derived = OutgoingId::derive(consumer, incoming, slot).unwrap();
        assert_eq!(derived.to_string(), id, "{consumer} {incoming} {slot}");
        assert_eq!(derived.as_uuid().get_version_num(), 5);
    }
    // The id is the text `MessageKey` gives: the integer 42 is the id "42".
    let cause = Cause::new("billing", 42_u64).unwrap();
    assert_eq!(
        cause.nth_id(0).to_string(),
        "cf283d54-4a74-58d3-9800-bcae0a7f3ed0"
    );
    assert_eq!(cause.nth_id(0), cause.id("0").unwrap());
    assert_ne!(cause.nth_id(0), cause.nth_id(1));
    // Downstream it is a message key: its text.
    let id = OutgoingId::derive("a", "b", "c").unwrap();
    assert_eq!(
        dedup_runtime::MessageKey::message_id(&id).as_str(),
        "650a349e-1748-5269-a350-c138a283c8a8"
    );
    assert_eq!(OutgoingId::from_uuid(id.as_uuid()), id);
}

#[test]
fn bad_causes_and_slots_are_refused() {
    assert!(matches!(
        Cause::new("", "evt"),
        Err(InvalidCause::Consumer(_))
    ));
    assert!(matches!(
        Cause::new("billing", ""),
        Err(InvalidCause::MessageId(InvalidMessageId::Empty))
    ));
    assert!(matches!(
        Cause::new("billing", "a\0b"),
        Err(InvalidCause::MessageId(InvalidMessageId::ContainsNul {
            position: 1
        }))
    ));
    let cause = Cause::new("billing", "evt").unwrap();
    assert_eq!(cause.id(""), Err(InvalidCause::EmptySlot));
    assert_eq!(
        cause.id("a\0"),
        Err(InvalidCause::SlotContainsNul { position: 1 })
    );
    let long = "s".repeat(MAX_NAME_LEN + 1);
    assert_eq!(
        cause.id(&long),
        Err(InvalidCause::SlotTooLong { len: 256, max: 255 })
    );
    assert_eq!(
        cause.id(&long).unwrap_err().to_string(),
        "invalid outgoing slot: it is 256 bytes, over the limit of 255"
    );
    assert!(cause.id(&long[..MAX_NAME_LEN]).is_ok());
}
