//! The arguments of `#[idempotent(…)]`: each set once, remembered with the span of the
//! token that gave it, so that a conflict points at the value that caused it.

// The limits are the runtime's own: one source for compile time and run time.
use dedup_limits::{
    DEFAULT_MAX_RESULT_LEN, MAX_CONSTRAINT_LEN, MAX_CONSUMER_LEN, MAX_RESULT_LEN,
    MAX_RESULT_VERSION, MAX_TABLE_NAME_LEN,
};
use proc_macro2::{Span, TokenStream, TokenTree};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, Ident, Lit, LitStr, Path, Token};

use crate::tokens::ungrouped_expr;

/// Every argument the attribute knows, in the order the messages list them.
const KNOWN: &str = "`consumer`, `key`, `batch`, `unique`, `table`, `effect`, `lease`, `result`, \
                     `result_version`, `max_result_len`, `fingerprint`, `crate`";

/// What `effect = "…"` declares for a body whose effect is outside the database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// `"send-first"`: the call, then the processed mark commits; a crash between the two
    /// repeats the call on redelivery, and nothing re-runs the body after it ran.
    SendFirst,
    /// `"mark-first"`: the processed mark (in progress) commits, then the call; a crash
    /// between the two loses the call, and the row says so (outcome unknown).
    MarkFirst,
}

/// The longest lease `lease = "…"` accepts, in milliseconds: a day (the runtime's
/// `MAX_LEASE`).
const MAX_LEASE_MS: u64 = 24 * 60 * 60 * 1000;
/// The lease of `effect = "mark-first"` without `lease = "…"` (the runtime's
/// `DEFAULT_MARK_LEASE`).
const DEFAULT_MARK_LEASE_MS: u64 = 60_000;

/// The consumer's name: a string literal, checked here, or the path of a `&str`
/// constant, checked when the constant is evaluated (`const _: () = check(PATH)` in the
/// expansion, see [`Consumer::check`]).
#[derive(Clone)]
pub enum Consumer {
    Literal(LitStr),
    Constant(syn::Path),
}

impl quote::ToTokens for Consumer {
    fn to_tokens(&self, tokens: &mut proc_macro2::TokenStream) {
        match self {
            Consumer::Literal(lit) => lit.to_tokens(tokens),
            Consumer::Constant(path) => path.to_tokens(tokens),
        }
    }
}

impl Consumer {
    /// For a constant: the item that checks its value at compile time (a constant
    /// evaluation that fails, with the span of the user's path); nothing for a literal,
    /// checked already.
    pub fn check(&self, private: &proc_macro2::TokenStream) -> proc_macro2::TokenStream {
        match self {
            Consumer::Literal(_) => proc_macro2::TokenStream::new(),
            Consumer::Constant(path) => {
                // Inline, every token spanned at the path: a failed check points at it.
                let span = syn::spanned::Spanned::span(path);
                quote::quote_spanned! {span=>
                    const _: () = {
                        let name: &str = #path;
                        ::core::assert!(
                            !name.is_empty(),
                            "`consumer` must not be empty: name the service that processes \
                             the message, such as `const CONSUMER: &str = \"email-sender\"`"
                        );
                        ::core::assert!(
                            name.len() <= #private::MAX_CONSUMER_LEN,
                            "`consumer` is longer than the dedup table stores \
                             (`dedup_runtime::MAX_CONSUMER_LEN` bytes)"
                        );
                        let bytes = name.as_bytes();
                        let mut at = 0;
                        while at < bytes.len() {
                            ::core::assert!(
                                bytes[at] != 0,
                                "`consumer` must not contain a NUL character"
                            );
                            at += 1;
                        }
                    };
                }
            }
        }
    }
}

/// The parsed and validated arguments.
pub struct Args {
    pub consumer: Option<Consumer>,
    pub key: Option<(Ident, Expr)>,
    /// `batch = orders`: the parameter that holds the messages of a batch handler, whose
    /// `key` is then a closure over one of them.
    pub batch: Option<Ident>,
    /// `batch` was written, whatever its value: the handler is meant as a batch handler.
    pub batch_named: bool,
    /// The unique constraints of `unique = …`; empty when not given.
    pub unique: Vec<LitStr>,
    pub table: LitStr,
    /// The effect declared with `effect = "…"`, when its value is one this version runs.
    pub effect: Option<Effect>,
    /// `effect` was written, whatever its value: the body may leave its connection unused
    /// (an error about that would be a second one for an effect refused already).
    pub effect_named: bool,
    /// The lease in milliseconds, when the call runs under one (`effect = "mark-first"`,
    /// or `effect = "send-first"` with `lease = "…"`): the body holds a `Lease`, not a
    /// connection.
    pub lease_ms: Option<u64>,
    /// `lease` was written, whatever its value: the body may take a `Lease` (an error
    /// about that would be a second one for a lease refused already).
    pub lease_named: bool,
    /// `result = "stored"`: the body's result is stored with the dedup row and replayed
    /// to duplicates (`StoredOutcome<T>`); its version and size limit.
    pub stored: Option<StoredResult>,
    /// `result` was written, whatever its value: the handler returns `StoredOutcome<T>`.
    pub result_named: bool,
    /// `fingerprint = …`: the payload (or the part of it) whose SHA-256 is compared.
    pub fingerprint: Option<Expr>,
    pub krate: Path,
    /// False when `crate = …` was given but could not be read: `krate` is then only the
    /// default, and code that names the runtime through it would fail once more.
    pub krate_known: bool,
}

/// `result = "stored"` with its `result_version` and `max_result_len`.
#[derive(Clone, Copy, Debug)]
pub struct StoredResult {
    pub version: u32,
    pub max_len: usize,
}

/// One `name = value` pair, before we know what the name means.
struct RawArg {
    name: Ident,
    value: Expr,
}

impl Parse for RawArg {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        // `crate` is a keyword, so accept any identifier here and judge the name later.
        let name = Ident::parse_any(input)?;
        if !input.peek(Token![=]) {
            return Err(syn::Error::new(
                name.span(),
                format_args!("expected `{name} = …`"),
            ));
        }
        input.parse::<Token![=]>()?;
        let value = input.parse()?;
        Ok(RawArg { name, value })
    }
}

/// Collects errors so the user sees every mistake at once.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(first) => first.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub fn add(&mut self, span: Span, message: impl std::fmt::Display) {
        self.push(syn::Error::new(span, message));
    }

    /// An error whose caret covers all of `tokens`, not only their first token.
    pub fn add_spanned(&mut self, tokens: impl quote::ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    pub fn finish(self) -> Result<(), syn::Error> {
        self.0.map_or(Ok(()), Err)
    }
}

/// A slot that accepts one value and reports a second one where it was written.
struct Once<T>(Option<(Ident, T)>);

impl<T> Once<T> {
    fn set(&mut self, name: Ident, value: T, errors: &mut Errors) {
        if self.0.is_some() {
            errors.add(
                name.span(),
                format_args!("`{name}` is given twice; keep one `{name} = …`"),
            );
        } else {
            self.0 = Some((name, value));
        }
    }
}

/// What of the arguments could not be read (its error reported already).
#[derive(Default)]
struct Unread {
    /// Something: what is missing cannot be judged then.
    any: bool,
    /// An argument that names `crate`: the runtime's path is unknown then.
    krate: bool,
}

/// The comma-separated `name = value` pairs. One that does not parse is reported and
/// skipped up to the next `,`, so that the others still count.
fn read(tokens: TokenStream, errors: &mut Errors) -> (Vec<RawArg>, Unread) {
    let parser = |input: ParseStream| {
        let mut raw = Vec::new();
        let mut unread = Unread::default();
        while !input.is_empty() {
            let start = input.fork();
            match input.parse::<RawArg>() {
                Ok(arg) => {
                    raw.push(arg);
                    if input.is_empty() || input.parse::<Option<Token![,]>>()?.is_some() {
                        continue;
                    }
                    errors.push(input.error("expected `,`"));
                }
                Err(error) => {
                    errors.push(error);
                    unread.krate |= skip_argument(&start)?;
                }
            }
            unread.any = true;
            unread.krate |= skip_argument(input)?;
        }
        Ok((raw, unread))
    };
    match syn::parse::Parser::parse2(parser, tokens) {
        Ok(read) => read,
        // Not expected (the parser reports its errors itself), but then nothing was read.
        Err(error) => {
            errors.push(error);
            let unread = Unread {
                any: true,
                krate: true,
            };
            (Vec::new(), unread)
        }
    }
}

/// Moves past the next top-level `,`; returns whether a `crate` came before it.
fn skip_argument(input: ParseStream) -> syn::Result<bool> {
    input.step(|cursor| {
        let mut rest = *cursor;
        let mut krate = false;
        while let Some((tree, next)) = rest.token_tree() {
            rest = next;
            match tree {
                TokenTree::Punct(punct) if punct.as_char() == ',' => break,
                TokenTree::Ident(ident) if ident == "crate" => krate = true,
                _ => {}
            }
        }
        Ok((krate, rest))
    })
}

/// Parses and validates the attribute's arguments.
///
/// Returns the arguments together with every error found, so that expansion can still
/// emit a function when something is wrong: an argument that cannot be read is left out
/// and reported.
pub fn parse(tokens: TokenStream) -> (Args, Errors) {
    let mut errors = Errors::default();
    let (raw, unread) = read(tokens, &mut errors);

    let mut consumer_given = false;
    let mut crate_given = unread.krate;
    let mut unique_named = false;
    let mut unknown_given = false;
    let mut effect_name: Option<Ident> = None;
    let mut consumer = Once(None);
    let mut key = Once(None);
    let mut unique = Once(None);
    let mut table = Once(None);
    let mut krate = Once(None);
    let mut effect = Once(None);
    let mut lease = Once(None);
    let mut lease_name: Option<Ident> = None;
    let mut batch = Once(None);
    let mut batch_name: Option<Ident> = None;
    let mut result = Once(None);
    let mut result_name: Option<Ident> = None;
    let mut result_version = Once(None);
    let mut max_result_len = Once(None);
    let mut fingerprint = Once(None);
    for RawArg { name, value } in raw {
        match name.to_string().as_str() {
            "consumer" => {
                consumer_given = true;
                match ungrouped_expr(&value) {
                    // A constant: `consumer = CONSUMER`, its name written once for the
                    // attribute and the code that needs it (an outbox `Cause`).
                    Expr::Path(path) if path.qself.is_none() && path.attrs.is_empty() => {
                        consumer.set(name, Consumer::Constant(path.path.clone()), &mut errors);
                    }
                    _ => {
                        if let Some(lit) = string_literal(
                            &name,
                            &value,
                            "consumer = \"email-sender\"` or the path of a `&str` constant, \
                             such as `consumer = CONSUMER",
                            &mut errors,
                        ) {
                            check_consumer(&lit, &mut errors);
                            consumer.set(name, Consumer::Literal(lit), &mut errors);
                        }
                    }
                }
            }
            "key" => key.set(name, value, &mut errors),
            "batch" => {
                batch_name.get_or_insert_with(|| name.clone());
                match ungrouped_expr(&value) {
                    Expr::Path(path) if path.qself.is_none() && path.path.get_ident().is_some() => {
                        let ident = path.path.get_ident().cloned();
                        if let Some(ident) = ident {
                            batch.set(name, ident, &mut errors);
                        }
                    }
                    _ => errors.add_spanned(
                        &value,
                        "`batch` names the handler's parameter that holds the messages, such \
                         as `batch = orders` for `orders: &[&Order]`",
                    ),
                }
            }
            "unique" => {
                unique_named = true;
                if let Some(names) = constraint_names(&value, &mut errors) {
                    unique.set(name, names, &mut errors);
                }
            }
            "table" => {
                if let Some(lit) =
                    string_literal(&name, &value, "table = \"processed_messages\"", &mut errors)
                {
                    check_table(&lit, &mut errors);
                    table.set(name, lit, &mut errors);
                }
            }
            "effect" => {
                effect_name.get_or_insert_with(|| name.clone());
                if let Some(lit) =
                    string_literal(&name, &value, "effect = \"send-first\"", &mut errors)
                    && let Some(value) = effect_value(&lit, &mut errors)
                {
                    effect.set(name, value, &mut errors);
                }
            }
            "lease" => {
                lease_name.get_or_insert_with(|| name.clone());
                if let Some(lit) = string_literal(&name, &value, "lease = \"30s\"", &mut errors)
                    && let Some(ms) = lease_value(&lit, &mut errors)
                {
                    lease.set(name, ms, &mut errors);
                }
            }
            "result" => {
                result_name.get_or_insert_with(|| name.clone());
                if let Some(lit) = string_literal(&name, &value, "result = \"stored\"", &mut errors)
                {
                    if lit.value() == "stored" {
                        result.set(name, (), &mut errors);
                    } else {
                        errors.add(
                            lit.span(),
                            format_args!(
                                "unknown `result` {:?}; write `result = \"stored\"` to store the \
                                 handler's result with the dedup row and replay it to duplicates",
                                lit.value()
                            ),
                        );
                    }
                }
            }
            "result_version" => {
                if let Some(version) = integer(
                    &name,
                    &value,
                    "result_version = 2",
                    u64::from(MAX_RESULT_VERSION),
                    &mut errors,
                ) {
                    result_version.set(name, version as u32, &mut errors);
                }
            }
            "max_result_len" => {
                if let Some(len) = integer(
                    &name,
                    &value,
                    "max_result_len = 65_536",
                    MAX_RESULT_LEN as u64,
                    &mut errors,
                ) {
                    max_result_len.set(name, len as usize, &mut errors);
                }
            }
            "fingerprint" => fingerprint.set(name, value, &mut errors),
            "crate" => {
                crate_given = true;
                if let Some(lit) =
                    string_literal(&name, &value, "crate = \"dedup_runtime\"", &mut errors)
                {
                    match lit.parse::<Path>() {
                        Ok(path) => krate.set(name, path, &mut errors),
                        Err(_) => errors.add(
                            lit.span(),
                            "`crate` takes the path of the runtime crate, such as `crate = \"my_app::dedup\"`",
                        ),
                    }
                }
            }
            other => {
                unknown_given = true;
                let hint = closest(other)
                    .map(|known| format!("did you mean `{known}`? "))
                    .unwrap_or_default();
                errors.add(
                    name.span(),
                    format_args!(
                        "unknown `idempotent` argument `{other}`; {hint}expected one of {KNOWN}"
                    ),
                );
            }
        }
    }

    let consumer = consumer.0;
    let key = key.0;
    let unique_given = unique_named;
    match (&key, &consumer) {
        // A misspelt or unreadable argument, or an invalid consumer, has been reported
        // already.
        _ if unread.any => {}
        (None, _)
            if unknown_given || unique_given || effect_name.is_some() || batch_name.is_some() => {}
        (Some(_), None) if consumer_given => {}
        (None, _) => errors.add(
            Span::call_site(),
            "`#[idempotent]` needs something to deduplicate on: the message id \
             (`#[idempotent(consumer = \"name\", key = msg.id)]`) or a unique constraint \
             the body would violate (`#[idempotent(unique = \"orders_pkey\")]`)",
        ),
        (Some((name, _)), None) => errors.add(
            name.span(),
            "`key` needs the name of the consumer the id is recorded for: \
             write `#[idempotent(consumer = \"name\", key = …)]`",
        ),
        (Some(_), Some(_)) => {}
    }
    if let (None, Some((name, _))) = (&key, &consumer)
        && unique_given
        && !unread.any
    {
        errors.add(
            name.span(),
            "`consumer` names whose message ids are recorded, and without `key` none is: \
             add `key = msg.id` to record the id too, or remove `consumer`",
        );
    }
    if let (None, Some(name)) = (&key, &effect_name)
        && !unread.any
    {
        errors.add(
            name.span(),
            "`effect` needs the message id: with `unique = …` alone a second copy is \
             recognised only when the body's own insert fails, and by then its external \
             call may have happened; add `consumer = \"name\", key = msg.id`, so that the \
             id is claimed before the body runs",
        );
    }
    let effect = effect.0.map(|(_, effect)| effect);
    if let Some(name) = &lease_name
        && effect_name.is_none()
        && !unread.any
    {
        errors.add(
            name.span(),
            "`lease` is for a handler whose call runs with no transaction open, and says how \
             long a copy of the message waits for it: declare the effect too, \
             `effect = \"send-first\", lease = \"30s\"` (the lease ends, the next delivery \
             calls again: pass the provider an idempotency key) or \
             `effect = \"mark-first\", lease = \"30s\"` (the lease ends, the outcome is \
             unknown and nothing calls again)",
        );
    }
    let lease_ms = match (effect, lease.0.map(|(_, ms)| ms)) {
        (Some(Effect::MarkFirst), ms) => Some(ms.unwrap_or(DEFAULT_MARK_LEASE_MS)),
        (Some(Effect::SendFirst), Some(ms)) => Some(ms),
        _ => None,
    };
    if lease_ms.is_some()
        && unique_given
        && !unread.any
        && let Some(name) = lease_name.as_ref().or(effect_name.as_ref())
    {
        errors.add(
            name.span(),
            "`unique = …` catches a business key that the body's insert violates inside the \
             claim's transaction, and a leased call runs outside it, after the claim \
             committed: remove `unique`, or use `effect = \"send-first\"` without `lease`, \
             whose body runs in the claim's transaction",
        );
    }
    check_batch(
        batch_name.as_ref(),
        key.as_ref(),
        effect_name.as_ref().or(lease_name.as_ref()),
        // A misspelt `batch` has been reported: a closure `key` is no second mistake.
        unread.any || (unknown_given && batch_name.is_none()),
        &mut errors,
    );
    let consumer = consumer.map(|(_, lit)| lit);
    let stored = remembered(
        RememberedArgs {
            result: result.0.map(|(name, ())| name),
            result_name: result_name.as_ref(),
            version: result_version.0,
            max_len: max_result_len.0,
            fingerprint: fingerprint.0.as_ref().map(|(name, value)| (name, value)),
            key: key.is_some(),
            batch: batch_name.is_some(),
            quiet: unread.any,
        },
        &mut errors,
    );

    let args = Args {
        stored,
        result_named: result_name.is_some(),
        fingerprint: fingerprint.0.map(|(_, value)| value),
        batch: batch.0.map(|(_, ident)| ident),
        batch_named: batch_name.is_some(),
        consumer,
        key,
        unique: unique.0.map(|(_, names)| names).unwrap_or_default(),
        table: table.0.map_or_else(
            || LitStr::new("processed_messages", Span::call_site()),
            |(_, lit)| lit,
        ),
        effect,
        effect_named: effect_name.is_some(),
        lease_ms,
        lease_named: lease_name.is_some(),
        krate_known: krate.0.is_some() || !crate_given,
        krate: krate
            .0
            .map_or_else(|| syn::parse_quote!(::dedup_runtime), |(_, path)| path),
    };
    (args, errors)
}

/// What `result`, `result_version`, `max_result_len` and `fingerprint` were given, and
/// what they need.
struct RememberedArgs<'a> {
    result: Option<Ident>,
    result_name: Option<&'a Ident>,
    version: Option<(Ident, u32)>,
    max_len: Option<(Ident, usize)>,
    fingerprint: Option<(&'a Ident, &'a Expr)>,
    key: bool,
    batch: bool,
    /// An argument could not be read: its error is the one to show.
    quiet: bool,
}

/// The rules of stored results and fingerprints: both need the message id's dedup row
/// (`key`); `result_version` and `max_result_len` go with `result`. A batch handler
/// fingerprints each message through a closure, and stores no result.
fn remembered(given: RememberedArgs<'_>, errors: &mut Errors) -> Option<StoredResult> {
    for (name, _) in [
        given.version.as_ref().map(|(n, _)| (n, ())),
        given.max_len.as_ref().map(|(n, _)| (n, ())),
    ]
    .into_iter()
    .flatten()
    {
        if given.result_name.is_none() {
            errors.add(
                name.span(),
                format_args!(
                    "`{name}` is a setting of the stored result: add `result = \"stored\"`, or \
                     remove `{name}`"
                ),
            );
        }
    }
    if !given.quiet {
        let fingerprint = given.fingerprint.map(|(name, _)| name);
        for name in [given.result_name, fingerprint].into_iter().flatten() {
            if !given.key && !given.batch {
                errors.add(
                    name.span(),
                    format_args!(
                        "`{name}` is kept in the message id's dedup row, and without `key` there \
                         is none: add `consumer = \"name\", key = msg.id`"
                    ),
                );
            }
        }
        if given.batch {
            if let Some(name) = given.result_name {
                errors.add(
                    name.span(),
                    format_args!(
                        "`{name}` stores a handler's value for each message, and the body of a \
                         batch handler returns one `()` for many messages: remove `{name}`, or \
                         handle these messages one at a time (`key = msg.id`), whose value is \
                         stored"
                    ),
                );
            }
            if let Some((_, value)) = given.fingerprint {
                batch_fingerprint(value, errors);
            }
        }
    }
    given.result.map(|_| StoredResult {
        version: given.version.map_or(1, |(_, version)| version),
        max_len: given.max_len.map_or(DEFAULT_MAX_RESULT_LEN, |(_, len)| len),
    })
}

/// `fingerprint = |order| order.body` of a batch handler: a closure over one message, that
/// does not await.
fn batch_fingerprint(value: &Expr, errors: &mut Errors) {
    let Expr::Closure(closure) = ungrouped_expr(value) else {
        errors.add_spanned(
            value,
            "in a batch handler `fingerprint` says what each message's payload is: write a \
             closure over one message, such as `fingerprint = |order| order.body`",
        );
        return;
    };
    per_message(closure, "fingerprint = |order| order.body", errors);
}

/// A batch handler's closure (`key`, `fingerprint`; `example` shows it) takes one message
/// and does not await.
fn per_message(closure: &syn::ExprClosure, example: &str, errors: &mut Errors) {
    let name = example.split(' ').next().unwrap_or(example);
    if closure.inputs.len() != 1 {
        errors.add_spanned(
            &closure.inputs,
            format_args!("the `{name}` of a batch handler takes one message: write `{example}`"),
        );
    } else if let Some(asyncness) = &closure.asyncness {
        errors.add(
            asyncness.span,
            format_args!(
                "the `{name}` of a batch handler is computed before the transaction begins, \
                 and cannot await: remove `async`"
            ),
        );
    }
}

/// A whole number from 1 to `max`, written as an integer literal.
fn integer(
    name: &Ident,
    value: &Expr,
    example: &str,
    max: u64,
    errors: &mut Errors,
) -> Option<u64> {
    if let Expr::Lit(lit) = ungrouped_expr(value)
        && let Lit::Int(int) = &lit.lit
    {
        match int.base10_parse::<u64>() {
            Ok(number) if (1..=max).contains(&number) => return Some(number),
            _ => {
                errors.add(
                    int.span(),
                    format_args!(
                        "`{name}` takes a whole number from 1 to {max}, such as `{example}`"
                    ),
                );
                return None;
            }
        }
    }
    errors.add(
        value.span(),
        format_args!("`{name}` takes an integer literal, such as `{example}`"),
    );
    None
}

/// The batch form's rules: `batch = …` with a closure `key`, no effect outside the
/// database; and a closure `key` only with `batch`.
fn check_batch(
    batch: Option<&Ident>,
    key: Option<&(Ident, Expr)>,
    effect: Option<&Ident>,
    unread: bool,
    errors: &mut Errors,
) {
    if unread {
        return;
    }
    let closure = key.and_then(|(_, key)| match ungrouped_expr(key) {
        Expr::Closure(closure) => Some(closure),
        _ => None,
    });
    match (batch, key) {
        (Some(batch), None) => errors.add(
            batch.span(),
            "`batch` needs the id of each message: add `consumer = \"name\", \
             key = |order| order.id`",
        ),
        (Some(_), Some((_, key))) => match closure {
            None => errors.add_spanned(
                key,
                "in a batch handler `key` says where each message's id is: write a closure \
                 over one message, such as `key = |order| order.id`",
            ),
            Some(closure) => per_message(closure, "key = |order| order.id", errors),
        },
        (None, Some(_)) => {
            if let Some(closure) = closure {
                errors.add(
                    closure.inputs_begin.span,
                    "a closure `key` is for a batch handler: add `batch = orders`, naming the \
                     parameter that holds the messages (`orders: &[&Order]`); for one message, \
                     write its id, `key = msg.id`",
                );
            }
        }
        (None, None) => {}
    }
    if let (Some(batch), Some(effect)) = (batch, effect) {
        errors.add(
            effect.span(),
            format_args!(
                "`{effect}` is for a handler whose effect is outside the database, and the \
                 body of a batch handler runs in the transaction of its claim, once for many \
                 messages: remove `{effect}`, or handle those messages one at a time \
                 (without `{batch}`)"
            ),
        );
    }
}

/// The names of `unique = "name"` or `unique = ["a", "b"]`, each a constraint or index
/// name, or `table.column` (SQLite).
fn constraint_names(value: &Expr, errors: &mut Errors) -> Option<Vec<LitStr>> {
    const FORM: &str = "`unique` takes the name of a unique constraint or index, or a list of \
                        them: `unique = \"shipments_order_id_key\"` or `unique = [\"a\", \"b\"]`";
    let literals: Vec<&Expr> = match ungrouped_expr(value) {
        Expr::Array(array) => {
            if array.elems.is_empty() {
                errors.add_spanned(value, format_args!("{FORM}; the list is empty"));
                return None;
            }
            array.elems.iter().collect()
        }
        other => vec![other],
    };
    let mut names: Vec<LitStr> = Vec::new();
    let mut ok = true;
    for expr in literals {
        let lit = match ungrouped_expr(expr) {
            Expr::Lit(lit) => match &lit.lit {
                Lit::Str(s) => s.clone(),
                _ => {
                    errors.add(expr.span(), FORM);
                    ok = false;
                    continue;
                }
            },
            _ => {
                errors.add(expr.span(), FORM);
                ok = false;
                continue;
            }
        };
        let name = lit.value();
        if name.is_empty() {
            errors.add(
                lit.span(),
                "a constraint name in `unique` must not be empty: write the name of the \
                 unique constraint or index, such as `unique = \"shipments_order_id_key\"`",
            );
            ok = false;
        } else if !dedup_limits::is_constraint_name(&name) {
            errors.add(
                lit.span(),
                format_args!(
                    "`{name}` is not a constraint name: write the name of a unique constraint \
                     or index (letters, digits, `_`, at most {MAX_CONSTRAINT_LEN} characters), \
                     or `table.column` for a single-column unique index on SQLite"
                ),
            );
            ok = false;
        } else if names.iter().any(|seen| seen.value() == name) {
            errors.add(
                lit.span(),
                format_args!("`{name}` is listed twice in `unique`"),
            );
            ok = false;
        } else {
            names.push(lit);
        }
    }
    ok.then_some(names)
}

/// The known argument an unknown one is probably a typo of: one edit away, or the same
/// letters in another case.
fn closest(unknown: &str) -> Option<&'static str> {
    fn distance(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut previous = row[0];
            row[0] = i + 1;
            for (j, cb) in b.iter().enumerate() {
                let substitution = previous + usize::from(ca != *cb);
                previous = row[j + 1];
                row[j + 1] = substitution.min(row[j] + 1).min(previous + 1);
            }
        }
        row[b.len()]
    }
    let lower = unknown.to_ascii_lowercase();
    [
        "consumer",
        "key",
        "batch",
        "unique",
        "table",
        "effect",
        "lease",
        "result",
        "result_version",
        "max_result_len",
        "fingerprint",
        "crate",
    ]
    .into_iter()
    .find(|known| distance(&lower, known) <= 2 && lower.len() + 2 > known.len())
}

/// The string literal behind `name = "…"`, or an error that shows the expected form.
fn string_literal(
    name: &Ident,
    value: &Expr,
    example: &str,
    errors: &mut Errors,
) -> Option<LitStr> {
    if let Expr::Lit(lit) = ungrouped_expr(value)
        && let Lit::Str(s) = &lit.lit
    {
        return Some(s.clone());
    }
    errors.add(
        value.span(),
        format_args!("`{name}` takes a string literal, such as `{example}`"),
    );
    None
}

/// The effect `effect = "…"` names.
fn effect_value(lit: &LitStr, errors: &mut Errors) -> Option<Effect> {
    let value = lit.value();
    match value.as_str() {
        "send-first" => Some(Effect::SendFirst),
        "mark-first" => Some(Effect::MarkFirst),
        other => {
            // `send_first`, `SendFirst`, `send first`: the spelling, not the choice, is off.
            let spelled: String = other
                .chars()
                .filter(|c| !matches!(c, '-' | '_' | ' '))
                .collect::<String>()
                .to_ascii_lowercase();
            let hint = match spelled.as_str() {
                "sendfirst" => "did you mean `\"send-first\"`? ",
                "markfirst" => "did you mean `\"mark-first\"`? ",
                _ => "",
            };
            errors.add(
                lit.span(),
                format_args!(
                    "unknown effect `{other:?}`; {hint}write `effect = \"send-first\"` (the \
                     call, then the processed mark: a crash between the two repeats the call) \
                     or `effect = \"mark-first\"` (the mark, then the call: a crash between \
                     the two loses the call, and the row says so)"
                ),
            );
            None
        }
    }
}

/// The milliseconds of `lease = "30s"`: a whole number and a unit (`ms`, `s`, `m`, `h`),
/// at least 1 ms and at most a day.
fn lease_value(lit: &LitStr, errors: &mut Errors) -> Option<u64> {
    const FORM: &str = "a whole number and a unit, `ms`, `s`, `m` or `h`, such as \
                        `lease = \"30s\"` or `lease = \"500ms\"`";
    let value = lit.value();
    let text = value.trim();
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let scale = match unit.trim() {
        "ms" => Some(1),
        "s" => Some(1_000),
        "m" | "min" => Some(60_000),
        "h" => Some(3_600_000),
        _ => None,
    };
    let (Ok(number), Some(scale)) = (number.parse::<u64>(), scale) else {
        errors.add(
            lit.span(),
            format_args!("`lease = {value:?}` is not a duration: write {FORM}"),
        );
        return None;
    };
    match number.checked_mul(scale) {
        Some(0) => {
            errors.add(
                lit.span(),
                "a lease of zero ends before the call starts, and every copy would take it \
                 over: give the time the call needs, such as `lease = \"30s\"`",
            );
            None
        }
        Some(ms) if ms <= MAX_LEASE_MS => Some(ms),
        _ => {
            errors.add(
                lit.span(),
                format_args!(
                    "`lease = {value:?}` is longer than a day: a crashed owner's message would \
                     wait that long; give the time one call needs (at most `lease = \"24h\"`) \
                     and renew it with `lease.extend()` for longer calls"
                ),
            );
            None
        }
    }
}

fn check_consumer(lit: &LitStr, errors: &mut Errors) {
    use dedup_limits::ConsumerProblem;
    match dedup_limits::consumer_problem(&lit.value()) {
        None => {}
        Some(ConsumerProblem::Empty) => errors.add(
            lit.span(),
            "`consumer` must not be empty: name the service that processes the message, \
             such as `consumer = \"email-sender\"`",
        ),
        Some(ConsumerProblem::ContainsNul { .. }) => {
            errors.add(lit.span(), "`consumer` must not contain a NUL character");
        }
        Some(ConsumerProblem::TooLong { len }) => errors.add(
            lit.span(),
            format_args!(
                "`consumer` is {len} bytes long; the dedup table stores at most \
                 {MAX_CONSUMER_LEN}"
            ),
        ),
    }
}

/// A table name is spliced into SQL, so it must be a plain identifier, optionally
/// qualified by a schema: `processed_messages` or `audit.processed_messages`.
fn check_table(lit: &LitStr, errors: &mut Errors) {
    if !dedup_limits::is_table_name(&lit.value()) {
        errors.add(
            lit.span(),
            format_args!(
                "`table` must be a plain SQL identifier (letters, digits, `_`, at most \
                 {MAX_TABLE_NAME_LEN} characters), optionally qualified by a schema: write \
                 `table = \"processed_messages\"` or `table = \"audit.processed_messages\"`"
            ),
        );
    }
}

#[cfg(test)]
mod tests;
