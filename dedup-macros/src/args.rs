//! The arguments of `#[idempotent(…)]`: each set once, remembered with the span of the
//! token that gave it, so that a conflict points at the value that caused it.

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, Ident, Lit, LitStr, Path, Token};

/// Every argument the attribute knows, in the order the messages list them.
const KNOWN: &str = "`consumer`, `key`, `unique`, `table`, `crate`";

/// The longest consumer name the dedup table stores, in bytes (the runtime's
/// `MAX_CONSUMER_LEN`; the two are checked against each other by a test).
const MAX_CONSUMER_LEN: usize = 255;

/// The longest constraint or index name every backend reports (MySQL's limit).
const MAX_CONSTRAINT_LEN: usize = 64;

/// The longest table or schema name every backend accepts (PostgreSQL's is the shortest).
const MAX_IDENT_LEN: usize = 63;

/// The parsed and validated arguments.
pub struct Args {
    pub consumer: Option<LitStr>,
    pub key: Option<(Ident, Expr)>,
    /// The unique constraints of `unique = …`; empty when not given.
    pub unique: Vec<LitStr>,
    pub table: LitStr,
    pub krate: Path,
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

/// Parses and validates the attribute's arguments.
///
/// Returns the arguments together with every error found, so that expansion can still
/// emit the user's function when something is wrong.
pub fn parse(tokens: TokenStream) -> (Option<Args>, Errors) {
    let mut errors = Errors::default();
    let raw =
        match syn::parse::Parser::parse2(Punctuated::<RawArg, Token![,]>::parse_terminated, tokens)
        {
            Ok(raw) => raw,
            Err(error) => {
                errors.push(error);
                return (None, errors);
            }
        };

    let mut consumer_given = false;
    let mut unique_named = false;
    let mut unknown_given = false;
    let mut consumer = Once(None);
    let mut key = Once(None);
    let mut unique = Once(None);
    let mut table = Once(None);
    let mut krate = Once(None);
    for RawArg { name, value } in raw {
        match name.to_string().as_str() {
            "consumer" => {
                consumer_given = true;
                if let Some(lit) =
                    string_literal(&name, &value, "consumer = \"email-sender\"", &mut errors)
                {
                    check_consumer(&lit, &mut errors);
                    consumer.set(name, lit, &mut errors);
                }
            }
            "key" => key.set(name, value, &mut errors),
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
            "crate" => {
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
        // A misspelt argument or an invalid consumer has been reported already.
        (None, _) if unknown_given || unique_given => {}
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
    {
        errors.add(
            name.span(),
            "`consumer` names whose message ids are recorded, and without `key` none is: \
             add `key = msg.id` to record the id too, or remove `consumer`",
        );
    }
    let consumer = consumer.map(|(_, lit)| lit);

    let args = Args {
        consumer,
        key,
        unique: unique.0.map(|(_, names)| names).unwrap_or_default(),
        table: table.0.map_or_else(
            || LitStr::new("processed_messages", Span::call_site()),
            |(_, lit)| lit,
        ),
        krate: krate
            .0
            .map_or_else(|| syn::parse_quote!(::dedup_runtime), |(_, path)| path),
    };
    (Some(args), errors)
}

/// The names of `unique = "name"` or `unique = ["a", "b"]`, each a constraint or index
/// name, or `table.column` (SQLite).
fn constraint_names(value: &Expr, errors: &mut Errors) -> Option<Vec<LitStr>> {
    const FORM: &str = "`unique` takes the name of a unique constraint or index, or a list of \
                        them: `unique = \"shipments_order_id_key\"` or `unique = [\"a\", \"b\"]`";
    let literals: Vec<&Expr> = match ungrouped(value) {
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
        let lit = match ungrouped(expr) {
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
        let plain = |part: &str| {
            let mut chars = part.chars();
            matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
                && part.len() <= MAX_CONSTRAINT_LEN
        };
        let parts: Vec<&str> = name.split('.').collect();
        if name.is_empty() {
            errors.add(
                lit.span(),
                "a constraint name in `unique` must not be empty: write the name of the \
                 unique constraint or index, such as `unique = \"shipments_order_id_key\"`",
            );
            ok = false;
        } else if parts.len() > 2 || !parts.iter().all(|part| plain(part)) {
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
    ["consumer", "key", "unique", "table", "crate"]
        .into_iter()
        .find(|known| distance(&lower, known) <= 2 && lower.len() + 2 > known.len())
}

/// `value` without the invisible group around a `$name:literal` or `$name:expr` that a
/// `macro_rules!` macro forwards to the attribute.
fn ungrouped(value: &Expr) -> &Expr {
    match value {
        Expr::Group(group) => ungrouped(&group.expr),
        other => other,
    }
}

/// The string literal behind `name = "…"`, or an error that shows the expected form.
fn string_literal(
    name: &Ident,
    value: &Expr,
    example: &str,
    errors: &mut Errors,
) -> Option<LitStr> {
    if let Expr::Lit(lit) = ungrouped(value)
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

fn check_consumer(lit: &LitStr, errors: &mut Errors) {
    let value = lit.value();
    if value.is_empty() {
        errors.add(
            lit.span(),
            "`consumer` must not be empty: name the service that processes the message, \
             such as `consumer = \"email-sender\"`",
        );
    } else if value.contains('\0') {
        errors.add(lit.span(), "`consumer` must not contain a NUL character");
    } else if value.len() > MAX_CONSUMER_LEN {
        errors.add(
            lit.span(),
            format_args!(
                "`consumer` is {} bytes long; the dedup table stores at most {MAX_CONSUMER_LEN}",
                value.len()
            ),
        );
    }
}

/// A table name is spliced into SQL, so it must be a plain identifier, optionally
/// qualified by a schema: `processed_messages` or `audit.processed_messages`.
fn check_table(lit: &LitStr, errors: &mut Errors) {
    let value = lit.value();
    let plain = |part: &str| {
        let mut chars = part.chars();
        matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
            && part.len() <= MAX_IDENT_LEN
    };
    let parts: Vec<&str> = value.split('.').collect();
    if parts.len() > 2 || !parts.iter().all(|part| plain(part)) {
        errors.add(
            lit.span(),
            format_args!(
                "`table` must be a plain SQL identifier (letters, digits, `_`, at most \
                 {MAX_IDENT_LEN} characters), optionally qualified by a schema: write \
                 `table = \"processed_messages\"` or `table = \"audit.processed_messages\"`"
            ),
        );
    }
}
