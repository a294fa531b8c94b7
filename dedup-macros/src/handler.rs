//! What `#[idempotent]` accepts as a handler, and why not when it refuses one.
//!
//! A handler is an `async fn` whose first parameter (after `self`) is the connection its
//! body works on, and which returns `Result<T, E>`. Everything else passes through.

use proc_macro2::{Spacing, Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::visit_mut::VisitMut;
use syn::{
    Attribute, Expr, FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, ReceiverKind,
    ReturnType, Type, TypePath,
};

use crate::args::Errors;
use crate::tokens::ungrouped_type;
use crate::types::generic_types;
pub use crate::types::{
    backend, error_type, names_transaction, ok_type, replace_ok, with_static_lifetimes,
};

/// The connection parameter: `tx: &mut PgConnection`.
pub struct Connection {
    /// The user's binding, re-bound to the generated transaction on every attempt.
    pub pat: Pat,
    /// The referent type, `PgConnection` or `Transaction<'_, Postgres>`.
    pub ty: Type,
    /// Position among `sig.inputs` (1 when there is a receiver).
    pub index: usize,
}

/// The handler's return type, `Result<T, E>` or an alias such as `anyhow::Result<T>`.
pub struct Output {
    /// The whole type as written.
    pub ty: Type,
}

pub struct Handler {
    pub item: ItemFn,
    pub connection: Connection,
    pub output: Output,
    pub retried: Retried,
    /// The call runs under a lease (`effect = "mark-first"`, or `lease = …`): the first
    /// parameter is a `Lease`, and the generated function takes a `&Pool`.
    pub leased: bool,
}

/// The error for a body that moves out of a parameter: it may run more than once, and the
/// expansion only finds out from the type checker, so the text is prepared here.
pub struct Retried {
    pub message: String,
    pub label: String,
    pub notes: Vec<String>,
    /// Where the caret goes: the parameter taken by value when there is only one, the
    /// handler's name otherwise.
    pub at: Span,
}

/// Checks the function, and the `key` expression against it; returns the parts the
/// expansion needs whenever its connection and return type were understood, even next to
/// errors (a missing `async`, an unused connection): the placeholder is built from them.
/// `external`: the attribute declares an effect outside the database (`effect = …`), so
/// the body may leave its connection unused.
pub fn analyze(
    item: ItemFn,
    key: Option<&Expr>,
    external: bool,
    leased: bool,
    batch: bool,
    errors: &mut Errors,
) -> Option<Handler> {
    // The attribute below this one expands next and checks the same function: anything
    // we reported too would show twice.
    if let Some(again) = item.attrs.iter().find(|attr| is_idempotent(attr)) {
        errors.add_spanned(
            again,
            "`#[idempotent]` is given twice; keep one attribute per handler, with every \
             argument in it: `#[idempotent(consumer = \"name\", key = msg.id, unique = \"…\")]`",
        );
        return None;
    }
    let sig = &item.sig;
    if sig.asyncness.is_none() {
        errors.add(
            sig.fn_token.span,
            "`#[idempotent]` handlers must be `async fn`: the body runs inside a database \
             transaction it awaits; write `async fn`",
        );
    }
    let connection = connection(&item, external, leased, batch, errors);
    if let (Some(connection), Some(key)) = (&connection, key) {
        check_key(key, connection, errors);
    }
    if let Some(connection) = &connection {
        pool_parameters(sig, connection, leased, errors);
    }
    let output = output(&item, errors);
    let connection = connection?;
    Some(Handler {
        leased,
        retried: retried(&item.sig, &connection, external),
        connection,
        output: output?,
        item,
    })
}

/// A parameter the body could move out of.
struct Movable {
    at: Span,
    /// Its name, when it is a plain binding.
    name: Option<String>,
    /// How to write it by reference; `None` for `&mut` (moved into a generic callee
    /// instead of reborrowed).
    by_reference: Option<String>,
}

// Input: `async fn send(tx: &mut PgConnection, msg: Email, n: u32)`.
// Output: the error for a body that moves out of `msg`, the one parameter it could move.
fn retried(sig: &syn::Signature, connection: &Connection, external: bool) -> Retried {
    let handler = sig.ident.unraw_string();
    // With `effect = …` the body runs at most once, but it is still called from the loop
    // that retries `BEGIN` and the claim: the note says that instead.
    let note = if external {
        "with `effect = …` the body runs at most once, but it is called from the loop that \
         retries `BEGIN` and the claim, so it must be callable again"
    } else {
        "transient failures (a serialization failure, a deadlock, a lock timeout) are \
         retried, and a retry runs the whole transaction body again"
    }
    .to_owned();
    let may = if external {
        "is called from a retry loop"
    } else {
        "may run more than once"
    };
    let movable = movable(sig, connection);
    match movable.as_slice() {
        [
            Movable {
                at,
                name: Some(name),
                by_reference: Some(by_reference),
            },
        ] => Retried {
            message: format!("the body of `{handler}` {may}, so it cannot move out of `{name}`"),
            label: format!("`{name}` is taken by value: the first attempt would use it up"),
            notes: vec![
                note,
                format!(
                    "take it by reference, `{by_reference}`, or clone what the body moves out \
                     of it"
                ),
            ],
            at: *at,
        },
        [
            Movable {
                at,
                name: Some(name),
                by_reference: None,
            },
        ] => Retried {
            message: format!("the body of `{handler}` {may}, so it cannot move `{name}`"),
            label: format!("the first attempt would use up `{name}`"),
            notes: vec![
                note,
                format!("reborrow it where the body passes it on: `&mut *{name}`"),
            ],
            at: *at,
        },
        all => {
            // Several taken by value: name them all when they are plain bindings.
            let named: Option<Vec<(&str, &str)>> = all
                .iter()
                .map(|movable| Some((movable.name.as_deref()?, movable.by_reference.as_deref()?)))
                .collect();
            let (label, fix) = match named {
                Some(named) if named.len() > 1 => (
                    format!(
                        "{} are taken by value: the first attempt may use them up",
                        list(named.iter().map(|(name, _)| format!("`{name}`")))
                    ),
                    format!(
                        "take them by reference ({}), or clone what the body moves out of them",
                        named
                            .iter()
                            .map(|(_, by_reference)| format!("`{by_reference}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ),
                _ => (
                    "the body moves a value out of a parameter, and a retry needs it again"
                        .to_owned(),
                    "take the message by reference (`msg: &Msg`), or clone what the body \
                     moves out of it"
                        .to_owned(),
                ),
            };
            Retried {
                message: format!(
                    "the body of `{handler}` {may}, so it cannot move out of its parameters"
                ),
                label,
                notes: vec![note, fix],
                at: match all {
                    [only] => only.at,
                    _ => sig.ident.span(),
                },
            }
        }
    }
}

/// The parameters other than the connection that a body could move out of: by value and
/// not a well-known `Copy` type, or `&mut`. (`&T` is `Copy`.)
fn movable(sig: &syn::Signature, connection: &Connection) -> Vec<Movable> {
    sig.inputs
        .iter()
        .enumerate()
        .filter(|(index, _)| *index != connection.index)
        .filter_map(|(_, input)| match input {
            FnArg::Receiver(receiver) => match receiver.kind {
                ReceiverKind::Reference(..) => None,
                _ => Some(Movable {
                    at: receiver.self_token.span,
                    name: Some("self".to_owned()),
                    by_reference: Some("&self".to_owned()),
                }),
            },
            FnArg::Typed(arg) => {
                let ty = ungrouped_type(&arg.ty);
                let by_reference = match ty {
                    Type::Reference(reference) if reference.mutability.is_none() => return None,
                    _ if is_known_copy(ty) => return None,
                    Type::Reference(_) => None,
                    ty => Some(type_text(ty)),
                };
                let (at, name) = match &*arg.pat {
                    Pat::Ident(binding) if binding.subpat.is_none() => {
                        (binding.ident.span(), Some(binding.ident.unraw_string()))
                    }
                    pat => (pat.span(), None),
                };
                let by_reference = by_reference.map(|ty| match &name {
                    Some(name) => format!("{name}: &{ty}"),
                    None => format!("&{ty}"),
                });
                Some(Movable {
                    at,
                    name,
                    by_reference,
                })
            }
        })
        .collect()
}

/// `a`, `a and b`, `a, b and c`.
fn list(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    match items.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Primitives and `Uuid`: taken by value, a body copies them rather than moving them.
fn is_known_copy(ty: &Type) -> bool {
    const COPY: &[&str] = &[
        "bool", "char", "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64",
        "i128", "isize", "f32", "f64", "Uuid",
    ];
    match ty {
        Type::Path(TypePath {
            qself: None, path, ..
        }) => path.segments.last().is_some_and(|last| {
            last.arguments.is_none() && COPY.iter().any(|name| last.ident == name)
        }),
        Type::Tuple(tuple) => tuple
            .elems
            .iter()
            .all(|elem| is_known_copy(ungrouped_type(elem))),
        _ => false,
    }
}

/// `ty` written out for a message, spaced as rustfmt would in the common cases
/// (`Vec<String>`, `impl Message + Send`, `&'a mut T`, `fn(u8) -> u8`).
fn type_text(ty: &Type) -> String {
    /// What the previous token was, for deciding whether a space goes between.
    #[derive(Clone, Copy, PartialEq)]
    enum Last {
        Start,
        Word,
        Keyword,
        Quote,
        Spaced,
        Other,
    }
    fn push(tokens: TokenStream, out: &mut String) {
        let mut last = Last::Start;
        for tree in tokens {
            let (text, before, after) = match &tree {
                TokenTree::Ident(ident) => {
                    let keyword = ["mut", "dyn", "impl", "const", "unsafe"]
                        .iter()
                        .any(|keyword| ident == keyword);
                    let after = if keyword { Last::Keyword } else { Last::Word };
                    (
                        tree.to_string(),
                        matches!(last, Last::Word | Last::Keyword),
                        after,
                    )
                }
                TokenTree::Literal(_) => (
                    tree.to_string(),
                    matches!(last, Last::Word | Last::Keyword),
                    Last::Word,
                ),
                TokenTree::Punct(punct) => match (punct.as_char(), punct.spacing()) {
                    ('\'', _) => (
                        "'".to_owned(),
                        matches!(last, Last::Word | Last::Keyword),
                        Last::Quote,
                    ),
                    (',' | ';', _) => (punct.to_string(), false, Last::Spaced),
                    // `&mut &mut T`, but `&&T`.
                    ('&', _) => ("&".to_owned(), last == Last::Keyword, Last::Other),
                    ('+' | '=', _) => (punct.to_string(), last != Last::Start, Last::Spaced),
                    ('-', Spacing::Joint) => ("-".to_owned(), last != Last::Start, Last::Other),
                    ('>', _) if out.ends_with('-') => (">".to_owned(), false, Last::Spaced),
                    _ => (punct.to_string(), false, Last::Other),
                },
                TokenTree::Group(group) => {
                    let (open, close) = match group.delimiter() {
                        proc_macro2::Delimiter::Parenthesis => ("(", ")"),
                        proc_macro2::Delimiter::Bracket => ("[", "]"),
                        proc_macro2::Delimiter::Brace => ("{", "}"),
                        proc_macro2::Delimiter::None => ("", ""),
                    };
                    let mut inner = String::new();
                    push(group.stream(), &mut inner);
                    // `mut [u8]`, `dyn (Trait)`, but `Fn(u8)`.
                    (
                        format!("{open}{inner}{close}"),
                        last == Last::Keyword,
                        Last::Other,
                    )
                }
            };
            if before || last == Last::Spaced {
                out.push(' ');
            }
            out.push_str(&text);
            last = after;
        }
    }
    let mut out = String::new();
    push(ty.to_token_stream(), &mut out);
    out
}

fn connection(
    item: &ItemFn,
    external: bool,
    leased: bool,
    batch: bool,
    errors: &mut Errors,
) -> Option<Connection> {
    let sig = &item.sig;
    let index = usize::from(sig.receiver().is_some());
    let Some(FnArg::Typed(arg)) = sig.inputs.iter().nth(index) else {
        errors.add(
            sig.paren_token.span.join(),
            "an `#[idempotent]` handler takes the connection its body works on as its first \
             parameter: add `tx: &mut sqlx::PgConnection` (or `SqliteConnection`, \
             `MySqlConnection`, `&mut sqlx::Transaction<'_, DB>`)",
        );
        return None;
    };

    let ty = match &*arg.ty {
        Type::Reference(reference) if reference.mutability.is_some() && leased => {
            if !is_lease(&reference.elem) {
                errors.add_spanned(
                    &reference.elem,
                    format_args!(
                        "a leased handler (`effect = \"mark-first\"`, or `lease = …`) holds no \
                         transaction while its call runs: take the lease instead, \
                         `{}: &mut dedup_runtime::Lease<'_, sqlx::{}>`; its `transaction()` is \
                         for the writes that record the call's result",
                        match &*arg.pat {
                            Pat::Ident(binding) => binding.ident.unraw_string(),
                            _ => "lease".to_owned(),
                        },
                        match backend(&reference.elem) {
                            Some("sqlite") => "Sqlite",
                            Some("mysql") => "MySql",
                            _ => "Postgres",
                        }
                    ),
                );
                return None;
            }
            (*reference.elem).clone()
        }
        Type::Reference(reference)
            if reference.mutability.is_some() && is_lease(&reference.elem) =>
        {
            errors.add_spanned(
                &reference.elem,
                "a `Lease` is what the body of a leased handler holds instead of a transaction: \
                 declare one, `effect = \"mark-first\"` or `effect = \"send-first\", \
                 lease = \"30s\"`; or take the connection, `tx: &mut sqlx::PgConnection`, for a \
                 body whose work is in the database",
            );
            return None;
        }
        Type::Reference(reference) if reference.mutability.is_some() => {
            if let Some(connection) = pool_connection(&reference.elem) {
                pool_error(&reference.elem, connection, errors);
                return None;
            }
            if let Some(what) = generic_connection(&reference.elem, &sig.generics) {
                errors.add_spanned(
                    &reference.elem,
                    format_args!(
                        "the connection of an `#[idempotent]` handler cannot be {what}: the \
                         generated function begins the transaction itself, on the database \
                         the connection type names; write `&mut sqlx::PgConnection` (or \
                         `SqliteConnection`, `MySqlConnection`, \
                         `&mut sqlx::Transaction<'_, DB>`)"
                    ),
                );
                return None;
            }
            if let Some(message) = not_a_connection(&reference.elem) {
                errors.add_spanned(&arg.ty, message);
                return None;
            }
            (*reference.elem).clone()
        }
        other => {
            let inner = match other {
                Type::Reference(reference) => &*reference.elem,
                other => other,
            };
            if let Some(connection) = pool_connection(inner) {
                pool_error(inner, connection, errors);
            } else {
                errors.add_spanned(
                    &arg.ty,
                    "the first parameter of an `#[idempotent]` handler is the connection its \
                     body works on, borrowed mutably: write `&mut PgConnection` (or \
                     `SqliteConnection`, `MySqlConnection`, `sqlx::Transaction<'_, DB>`)",
                );
            }
            return None;
        }
    };

    // From here on the type is understood: a mistake in the binding is reported, and the
    // connection still returned, so that callers see the generated signature.
    if let Pat::Ident(binding) = &*arg.pat {
        let unused = find_use(|visitor| visitor.visit_block(&item.block), &binding.ident).is_none();
        if unused && batch {
            errors.add(
                binding.ident.span(),
                format_args!(
                    "the body never uses `{0}`, so its effects would not be atomic with the \
                     batch's dedup records: run its queries on `{0}` (for example \
                     `.execute(&mut *{0})`), so that they commit or roll back with them; for \
                     an effect outside the database (an email, an HTTP call), handle the \
                     messages one at a time and declare `effect = \"send-first\"` or \
                     `effect = \"mark-first\"`",
                    binding.ident.unraw_string()
                ),
            );
        } else if !external && unused {
            errors.add(
                binding.ident.span(),
                format_args!(
                    "the body never uses `{0}`, so its effects would not be atomic with the \
                     dedup record: run the handler's queries on `{0}` (for example \
                     `.execute(&mut *{0})`) so that they commit or roll back together with \
                     it; if the body's effect is outside the database (an email, an HTTP \
                     call), declare which risk it takes: `effect = \"send-first\"` (a crash \
                     between the call and the commit repeats the call: pass the provider an \
                     idempotency key) or `effect = \"mark-first\"` (the message is marked \
                     first: a crash before the call completes loses it, and the row says so)",
                    binding.ident.unraw_string()
                ),
            );
        }
    } else {
        errors.add_spanned(
            &arg.pat,
            "bind the connection to a plain name, such as `tx: &mut PgConnection`",
        );
    }
    Some(Connection {
        pat: (*arg.pat).clone(),
        ty,
        index,
    })
}

/// Whether `ty` names the runtime's `Lease` (`Lease<'_, Postgres>`, `dedup_runtime::Lease<…>`).
fn is_lease(ty: &Type) -> bool {
    matches!(ungrouped_type(ty), Type::Path(TypePath { path, .. })
        if path.segments.last().is_some_and(|last| last.ident == "Lease"))
}

/// Whether `attr` is `#[idempotent(…)]`, however its path is written.
fn is_idempotent(attr: &Attribute) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == "idempotent")
}

/// What to call `ty` when it is not one concrete type: a type parameter of the handler,
/// such as `C` in `fn h<C>(tx: &mut C)`, or `impl Trait`.
fn generic_connection(ty: &Type, generics: &syn::Generics) -> Option<String> {
    match ty {
        Type::Group(group) => generic_connection(&group.elem, generics),
        Type::Paren(paren) => generic_connection(&paren.elem, generics),
        Type::ImplTrait(_) => Some("`impl Trait`".to_owned()),
        Type::TraitObject(_) => Some("`dyn Trait`".to_owned()),
        Type::Path(TypePath {
            qself: None, path, ..
        }) if path.leading_colon.is_none() => {
            let first = &path.segments.first()?.ident;
            let what = if path.segments.len() == 1 {
                format!("the type parameter `{first}`")
            } else {
                format!("a type of the type parameter `{first}`")
            };
            generics
                .type_params()
                .any(|param| param.ident == *first)
                .then_some(what)
        }
        _ => None,
    }
}

// Input: the referent of the connection parameter, such as `&mut PgConnection` in
// `tx: &mut &mut PgConnection`.
// Output: the error for a type that no alias can make a connection: a reference, a slice,
// a tuple… A path is left to the type checker, whatever its name: `type Conn =
// PgConnection;` makes `&mut Conn` right, and only the checker knows.
fn not_a_connection(ty: &Type) -> Option<String> {
    const WRITE: &str = "write `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection`, \
                         `&mut sqlx::MySqlConnection` or `&mut sqlx::Transaction<'_, DB>`";
    match ty {
        Type::Group(group) => not_a_connection(&group.elem),
        Type::Paren(paren) => not_a_connection(&paren.elem),
        Type::Reference(reference) => {
            let mut inner = &*reference.elem;
            while let Type::Reference(reference) = ungrouped_type(inner) {
                inner = &reference.elem;
            }
            Some(match ungrouped_type(inner) {
                Type::Path(_) => format!(
                    "the connection of an `#[idempotent]` handler is borrowed once: write \
                     `&mut {}`",
                    type_text(inner)
                ),
                _ => format!(
                    "the connection of an `#[idempotent]` handler is borrowed once; {WRITE}"
                ),
            })
        }
        Type::Slice(_)
        | Type::Array(_)
        | Type::Tuple(_)
        | Type::Ptr(_)
        | Type::FnPtr(_)
        | Type::Never(_) => Some(format!(
            "`{}` is not a connection an `#[idempotent]` handler can run on; {WRITE}",
            type_text(ty)
        )),
        _ => None,
    }
}

// Input: `key = session_id(tx)`, with `tx` the connection.
// Output: an error at `tx`: the key is evaluated before the transaction exists.
fn check_key(key: &Expr, connection: &Connection, errors: &mut Errors) {
    let Pat::Ident(binding) = &connection.pat else {
        return;
    };
    if let Some(at) = find_use(|visitor| visitor.visit_expr(key), &binding.ident) {
        errors.add(
            at,
            format_args!(
                "`key` is evaluated before the transaction begins, so it cannot use the \
                 connection `{0}`: take the id from the message, such as `key = msg.id`",
                binding.ident.unraw_string()
            ),
        );
    }
}

/// `Some("PgConnection")` when `ty` names a pool, with the connection to write instead.
fn pool_connection(ty: &Type) -> Option<&'static str> {
    let Type::Path(TypePath { path, .. }) = ty else {
        return None;
    };
    let last = path.segments.last()?.ident.to_string();
    match last.as_str() {
        "PgPool" => Some("PgConnection"),
        "SqlitePool" => Some("SqliteConnection"),
        "MySqlPool" => Some("MySqlConnection"),
        "Pool" | "AnyPool" => Some("PgConnection"),
        _ => None,
    }
}

// Input: `async fn h(tx: &mut PgConnection, pool: &PgPool, msg: &Msg)`.
// Output: an error at `PgPool`. Statements run on a pool commit on their own, outside the
// handler's transaction: a redelivery applies them again, a failure does not undo them.
// Only sqlx's pools are named (`PgPool`, `SqlitePool`, `MySqlPool`, `AnyPool`, and
// `Pool<DB>` of a sqlx database), through `&`, `Arc` and `Box`: another crate's `Pool` (an
// HTTP or Redis client's) is a parameter like any other.
fn pool_parameters(
    sig: &syn::Signature,
    connection: &Connection,
    leased: bool,
    errors: &mut Errors,
) {
    for (index, arg) in sig.inputs.iter().enumerate() {
        let FnArg::Typed(arg) = arg else { continue };
        if index == connection.index {
            continue;
        }
        if let Some(pool) = sqlx_pool(&arg.ty) {
            let instead = if leased {
                "in the lease's transaction (`lease.transaction().await?`), which commits \
                 with the processed mark"
            } else {
                "on the connection parameter (`&mut *tx`)"
            };
            errors.add_spanned(
                pool,
                format_args!(
                    "an `#[idempotent]` handler never takes a pool: what the body runs on it \
                     commits on its own, outside the handler's transaction, so a redelivery \
                     would apply it again and a failure would not undo it; run every \
                     statement {instead}, and remove this one"
                ),
            );
        }
    }
}

/// The sqlx pool type inside `ty` (`&PgPool`, `Arc<Pool<Postgres>>`), if it is one.
fn sqlx_pool(ty: &Type) -> Option<&Type> {
    match ty {
        Type::Reference(reference) => sqlx_pool(&reference.elem),
        Type::Paren(inner) => sqlx_pool(&inner.elem),
        Type::Group(inner) => sqlx_pool(&inner.elem),
        Type::Path(TypePath {
            qself: None, path, ..
        }) => {
            let last = path.segments.last()?;
            match last.ident.to_string().as_str() {
                "PgPool" | "SqlitePool" | "MySqlPool" | "AnyPool" => Some(ty),
                "Pool" if generic_types(last).any(is_sqlx_database) => Some(ty),
                "Arc" | "Rc" | "Box" => generic_types(last).next().and_then(sqlx_pool),
                _ => None,
            }
        }
        _ => None,
    }
}

fn is_sqlx_database(ty: &Type) -> bool {
    let Type::Path(TypePath { path, .. }) = ty else {
        return false;
    };
    path.segments.last().is_some_and(|last| {
        matches!(
            last.ident.to_string().as_str(),
            "Postgres" | "Sqlite" | "MySql" | "Any"
        )
    })
}

fn pool_error(ty: &Type, connection: &str, errors: &mut Errors) {
    errors.add_spanned(
        ty,
        format_args!(
            "the first parameter of an `#[idempotent]` handler is the connection its body \
             works on, not a pool: write `tx: &mut {connection}` (or \
             `&mut sqlx::Transaction<'_, DB>`); callers of the generated function pass \
             `&pool`, and it opens the transaction for you"
        ),
    );
}

fn output(item: &ItemFn, errors: &mut Errors) -> Option<Output> {
    let sig = &item.sig;
    let ReturnType::Type(_, ty) = &sig.output else {
        errors.add(
            sig.ident.span(),
            "an `#[idempotent]` handler returns `Result<T, E>` with `E: From<sqlx::Error>`: \
             write `-> Result<(), sqlx::Error>`",
        );
        return None;
    };
    let error = |errors: &mut Errors| {
        errors.add_spanned(
            ty,
            "an `#[idempotent]` handler returns `Result<T, E>` with `E: From<sqlx::Error>`, \
             so that an error rolls the transaction back: write \
             `Result<(), sqlx::Error>` (or `anyhow::Result<()>`, `Result<T, MyError>`)",
        );
    };
    let Type::Path(TypePath {
        qself: None, path, ..
    }) = &**ty
    else {
        error(errors);
        return None;
    };
    let Some(last) = path.segments.last() else {
        error(errors);
        return None;
    };
    let PathArguments::AngleBracketed(arguments) = &last.arguments else {
        error(errors);
        return None;
    };
    let types = arguments
        .args
        .iter()
        .filter(|arg| matches!(arg, GenericArgument::Type(_)))
        .count();
    if last.ident != "Result" || !(1..=2).contains(&types) {
        error(errors);
        return None;
    }
    Some(Output { ty: (**ty).clone() })
}

/// The type with every `impl Trait` replaced by `_`: what a `let` can name of it.
pub fn nameable(ty: &Type) -> Type {
    struct Infer;
    impl VisitMut for Infer {
        fn visit_type_mut(&mut self, ty: &mut Type) {
            if let Type::ImplTrait(impl_trait) = ty {
                *ty = Type::Infer(syn::TypeInfer {
                    attrs: Vec::new(),
                    underscore_token: syn::Token![_](impl_trait.impl_token.span),
                });
            } else {
                syn::visit_mut::visit_type_mut(self, ty);
            }
        }
    }
    let mut ty = ty.clone();
    Infer.visit_type_mut(&mut ty);
    ty
}

/// Where the variable `ident` is first used in what `visit` walks: as a path of its own
/// (`tx`, `&mut *tx`, `tx.begin()`), not as a field or method name (`msg.tx`) or a path
/// segment (`module::tx`). Macro arguments count where the name stands alone in them.
fn find_use(visit: impl FnOnce(&mut FindUse<'_>), ident: &Ident) -> Option<Span> {
    let name = ident.unraw_string();
    let mut finder = FindUse {
        name: &name,
        found: None,
    };
    visit(&mut finder);
    finder.found
}

struct FindUse<'a> {
    name: &'a str,
    found: Option<Span>,
}

impl FindUse<'_> {
    fn found(&mut self, span: Span) {
        self.found.get_or_insert(span);
    }

    /// Tokens we cannot parse as expressions (macro arguments): a standalone identifier
    /// counts, one after `.`, `::` or `'` does not.
    fn visit_tokens(&mut self, tokens: TokenStream) {
        // The two punctuation characters before the current token, the first one only
        // when it is joined to the second (`..`, `::`).
        let mut last: Option<(char, Spacing)> = None;
        let mut joined: Option<char> = None;
        for tree in tokens {
            match &tree {
                TokenTree::Ident(ident) => {
                    let after_field_dot =
                        last == Some(('.', Spacing::Alone)) && joined != Some('.');
                    let after_path = last.is_some_and(|(c, _)| c == ':') && joined == Some(':');
                    let after_quote = last.is_some_and(|(c, _)| c == '\'');
                    if ident.unraw_string() == self.name
                        && !after_field_dot
                        && !after_path
                        && !after_quote
                    {
                        self.found(ident.span());
                    }
                }
                TokenTree::Group(group) => self.visit_tokens(group.stream()),
                TokenTree::Punct(_) | TokenTree::Literal(_) => {}
            }
            if let TokenTree::Punct(punct) = &tree {
                joined = last
                    .filter(|(_, spacing)| *spacing == Spacing::Joint)
                    .map(|(c, _)| c);
                last = Some((punct.as_char(), punct.spacing()));
            } else {
                (last, joined) = (None, None);
            }
        }
    }
}

impl<'ast> Visit<'ast> for FindUse<'_> {
    fn visit_expr_path(&mut self, expr: &'ast syn::ExprPath) {
        if expr.qself.is_none()
            && let Some(ident) = expr.path.get_ident()
            && ident.unraw_string() == self.name
        {
            self.found(ident.span());
        }
        syn::visit::visit_expr_path(self, expr);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_tokens(mac.tokens.clone());
    }

    fn visit_expr(&mut self, expr: &'ast Expr) {
        if let Expr::Verbatim(tokens) = expr {
            self.visit_tokens(tokens.clone());
        } else {
            syn::visit::visit_expr(self, expr);
        }
    }
}

trait UnrawString {
    fn unraw_string(&self) -> String;
}

impl UnrawString for Ident {
    fn unraw_string(&self) -> String {
        syn::ext::IdentExt::unraw(self).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uses(body: &str) -> bool {
        let block: syn::Block = syn::parse_str(&format!("{{ {body} }}")).unwrap();
        let tx: Ident = syn::parse_str("tx").unwrap();
        find_use(|visitor| visitor.visit_block(&block), &tx).is_some()
    }

    #[test]
    fn a_use_is_the_variable_not_its_name() {
        for body in [
            "tx;",
            "query().execute(&mut *tx).await?;",
            "insert(tx, id).await",
            "tx.begin().await",
            "Shape { tx }",
            "for _ in 0..tx {}",
            "sqlx::query!(\"SELECT 1\").execute(&mut *tx);",
            "println!(\"{}\", tx);",
            "m!(a..tx);",
            "r#tx;",
        ] {
            assert!(uses(body), "`{body}` uses `tx`");
        }
        for body in [
            "msg.tx;",
            "msg.tx();",
            "module::tx();",
            "Shape { tx: 1 }",
            "let _: &'tx str;",
            "println!(\"{}\", msg.tx);",
            "m!(a::tx, msg?.tx, 'tx: loop {});",
        ] {
            assert!(!uses(body), "`{body}` does not use `tx`");
        }
    }

    #[test]
    fn types_in_messages() {
        for text in [
            "Email",
            "Vec<String>",
            "HashMap<String, Vec<u8>>",
            "impl Message + Send",
            "&'a mut [u8; 4]",
            "Box<dyn Fn(u8) -> u8>",
            "Transaction<'_, Postgres>",
            "&mut &mut PgConnection",
            "&&str",
        ] {
            let ty: Type = syn::parse_str(text).unwrap();
            assert_eq!(type_text(&ty), text);
        }
    }

    #[test]
    fn generic_connections() {
        let generics: syn::Generics = syn::parse_str("<'a, C, const N: usize>").unwrap();
        let what = |ty: &str| generic_connection(&syn::parse_str(ty).unwrap(), &generics);
        assert_eq!(what("C").as_deref(), Some("the type parameter `C`"));
        assert_eq!(
            what("C::Connection").as_deref(),
            Some("a type of the type parameter `C`")
        );
        assert_eq!(what("impl Acquire").as_deref(), Some("`impl Trait`"));
        assert_eq!(what("dyn Executor").as_deref(), Some("`dyn Trait`"));
        assert_eq!(what("PgConnection"), None);
        assert_eq!(what("sqlx::Transaction<'a, sqlx::Postgres>"), None);
    }

    #[test]
    fn only_what_no_alias_can_name_is_refused() {
        let refused = |ty: &str| not_a_connection(&syn::parse_str(ty).unwrap());
        assert_eq!(
            refused("&mut PgConnection").as_deref(),
            Some(
                "the connection of an `#[idempotent]` handler is borrowed once: write \
                 `&mut PgConnection`"
            )
        );
        for ty in [
            "&sqlx::PgConnection",
            "&mut [u8]",
            "[u8]",
            "(PgConnection,)",
            "()",
            "fn()",
        ] {
            assert!(refused(ty).is_some(), "`{ty}` is refused");
        }
        // A path may be an alias of a connection, whatever it is called.
        for ty in [
            "String",
            "Conn",
            "Vec<u8>",
            "my::Conn<'static>",
            "(Conn)",
            "conn!()",
        ] {
            assert!(refused(ty).is_none(), "`{ty}` is left to the type checker");
        }
    }
}
