//! The attribute's arguments, parsed and refused.

use super::*;

/// The messages of `parse(tokens)`, and whether the runtime's path is known.
fn parsed(tokens: &str) -> (Vec<String>, Args) {
    let (args, errors) = parse(tokens.parse().unwrap());
    let messages = match errors.finish() {
        Ok(()) => Vec::new(),
        Err(error) => error.into_iter().map(|error| error.to_string()).collect(),
    };
    (messages, args)
}

#[test]
fn an_unreadable_argument_is_the_only_error_and_the_others_count() {
    let (messages, args) = parsed(r#"consumer = "billing", key, table = "t""#);
    assert_eq!(messages, ["expected `key = …`"]);
    assert_eq!(args.table.value(), "t");
    assert!(args.krate_known);

    let (messages, args) = parsed(r#"consumer = "billing" key = msg.id, table = "t""#);
    assert_eq!(messages, ["expected `,`"]);
    let consumer = match args.consumer {
        Some(Consumer::Literal(lit)) => Some(lit.value()),
        _ => None,
    };
    assert_eq!(consumer.as_deref(), Some("billing"));
    assert_eq!(args.table.value(), "t");

    let (messages, _) = parsed(r#"= 1, consumer = "billing", key = id"#);
    assert_eq!(messages.len(), 1, "{messages:?}");
}

#[test]
fn a_consumer_is_a_literal_or_the_path_of_a_constant() {
    let (messages, args) = parsed("consumer = names::BILLING, key = id");
    assert!(messages.is_empty(), "{messages:?}");
    assert!(matches!(args.consumer, Some(Consumer::Constant(_))));
    let (messages, _) = parsed("consumer = name(), key = id");
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].contains("the path of a `&str` constant"),
        "{messages:?}"
    );
}

#[test]
fn effects() {
    let (messages, args) = parsed(r#"consumer = "c", key = id, effect = "send-first""#);
    assert!(messages.is_empty(), "{messages:?}");
    assert_eq!(args.effect, Some(Effect::SendFirst));
    assert!(args.effect_named);

    // Mark-first runs under a lease, a minute unless given.
    let (messages, args) = parsed(r#"consumer = "c", key = id, effect = "mark-first""#);
    assert!(messages.is_empty(), "{messages:?}");
    assert_eq!(args.effect, Some(Effect::MarkFirst));
    assert_eq!(args.lease_ms, Some(60_000));
    let (messages, args) =
        parsed(r#"consumer = "c", key = id, effect = "send-first", lease = "1500ms""#);
    assert!(messages.is_empty(), "{messages:?}");
    assert_eq!(args.lease_ms, Some(1500));
    let (_, args) = parsed(r#"consumer = "c", key = id, effect = "send-first""#);
    assert_eq!(args.lease_ms, None);
    for (lease, ms) in [
        ("30s", 30_000),
        ("2m", 120_000),
        ("1h", 3_600_000),
        ("24h", 86_400_000),
    ] {
        let (messages, args) = parsed(&format!(
            r#"consumer = "c", key = id, effect = "mark-first", lease = "{lease}""#
        ));
        assert!(messages.is_empty(), "{lease}: {messages:?}");
        assert_eq!(args.lease_ms, Some(ms), "{lease}");
    }
    for (lease, says) in [
        ("0s", "a lease of zero"),
        ("25h", "longer than a day"),
        ("-5s", "is not a duration"),
        ("1.5s", "is not a duration"),
        ("30", "is not a duration"),
        ("30 seconds", "is not a duration"),
    ] {
        let (messages, _) = parsed(&format!(
            r#"consumer = "c", key = id, effect = "mark-first", lease = "{lease}""#
        ));
        assert_eq!(messages.len(), 1, "{lease}: {messages:?}");
        assert!(messages[0].contains(says), "{lease}: {messages:?}");
    }
    let (messages, _) = parsed(r#"consumer = "c", key = id, lease = "30s""#);
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with("`lease` is for a handler"),
        "{messages:?}"
    );
    let (messages, _) = parsed(r#"consumer = "c", key = id, unique = "u", effect = "mark-first""#);
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with("`unique = …` catches"),
        "{messages:?}"
    );

    for (spelling, hint) in [
        ("send_first", Some("send-first")),
        ("SendFirst", Some("send-first")),
        ("mark first", Some("mark-first")),
        ("at-most-once", None),
    ] {
        let (messages, _) = parsed(&format!(
            r#"consumer = "c", key = id, effect = "{spelling}""#
        ));
        assert_eq!(messages.len(), 1, "{messages:?}");
        let expected = hint.map(|hint| format!("did you mean `\"{hint}\"`?"));
        assert_eq!(
            expected.is_some_and(|expected| messages[0].contains(&expected)),
            hint.is_some(),
            "{spelling}: {messages:?}"
        );
    }

    // Without `key`, the one message says to add it (not also "nothing to deduplicate on").
    for tokens in [
        r#"effect = "send-first""#,
        r#"unique = "u", effect = "send-first""#,
    ] {
        let (messages, _) = parsed(tokens);
        assert_eq!(messages.len(), 1, "{tokens}: {messages:?}");
        assert!(
            messages[0].starts_with("`effect` needs the message id"),
            "{messages:?}"
        );
    }
}

#[test]
fn batches() {
    let (messages, args) = parsed(r#"consumer = "c", batch = orders, key = |o| o.id"#);
    assert!(messages.is_empty(), "{messages:?}");
    assert_eq!(args.batch.map(|b| b.to_string()).as_deref(), Some("orders"));
    assert!(args.batch_named);
    for (tokens, says) in [
        (r#"consumer = "c", batch = orders"#, "`batch` needs the id"),
        (
            r#"consumer = "c", batch = orders, key = o.id"#,
            "write a closure",
        ),
        (
            r#"consumer = "c", batch = orders, key = |a, b| a.id"#,
            "takes one message",
        ),
        (
            r#"consumer = "c", batch = orders, key = async |o| o.id"#,
            "cannot await",
        ),
        (r#"consumer = "c", key = |o| o.id"#, "add `batch = orders`"),
        (
            r#"consumer = "c", batch = "orders", key = |o| o.id"#,
            "names the handler's",
        ),
        (
            r#"consumer = "c", batch = orders, key = |o| o.id, effect = "send-first""#,
            "remove `effect`",
        ),
    ] {
        let (messages, _) = parsed(tokens);
        assert_eq!(messages.len(), 1, "{tokens}: {messages:?}");
        assert!(messages[0].contains(says), "{tokens}: {messages:?}");
    }
    let (messages, _) = parsed(r#"consumer = "c", batchh = orders, key = |o| o.id"#);
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].contains("did you mean `batch`?"),
        "{messages:?}"
    );
}

#[test]
fn the_runtime_path_is_known_unless_crate_was_given_and_unreadable() {
    for (tokens, known) in [
        (r#"consumer = "", key = id"#, true),
        (r#"consumer = "", key = id, crate = "my_app::dedup""#, true),
        (r#"consumer = "b", key = id, crate = "not a path""#, false),
        (r#"consumer = "b", key = id, crate = my_app::dedup"#, false),
        (r#"consumer = "b", key = id, crate"#, false),
        (r#"consumer = "b" crate = "my_app::dedup""#, false),
    ] {
        assert_eq!(parsed(tokens).1.krate_known, known, "{tokens}");
    }
    let (_, args) = parsed(r#"consumer = "", key = id, crate = "my_app::dedup""#);
    let krate = args.krate;
    assert_eq!(quote::quote!(#krate).to_string(), "my_app :: dedup");
}
