//! What `#[idempotent]` accepts as a handler, and why not when it refuses one.
//!
//! A handler is an `async fn` whose first parameter (after `self`) is the connection its
//! body works on, and which returns `Result<T, E>`. Everything else passes through.

use proc_macro2::{TokenStream, TokenTree};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{
    FnArg, GenericArgument, Ident, ItemFn, Lifetime, Pat, PathArguments, ReturnType, Type, TypePath,
};

use crate::args::Errors;

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
}

/// Checks the function; on success returns the parts the expansion needs.
pub fn analyze(item: ItemFn, errors: &mut Errors) -> Option<Handler> {
    let sig = &item.sig;
    if sig.asyncness.is_none() {
        errors.add(
            sig.fn_token.span,
            "`#[idempotent]` handlers must be `async fn`: the body runs inside a database \
             transaction it awaits; write `async fn`",
        );
    }
    let connection = connection(&item, errors);
    let output = output(&item, errors);
    Some(Handler {
        connection: connection?,
        output: output?,
        item,
    })
}

fn connection(item: &ItemFn, errors: &mut Errors) -> Option<Connection> {
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
        Type::Reference(reference) if reference.mutability.is_some() => {
            if let Some(connection) = pool_connection(&reference.elem) {
                pool_error(&reference.elem, connection, errors);
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

    let Pat::Ident(binding) = &*arg.pat else {
        errors.add_spanned(
            &arg.pat,
            "bind the connection to a plain name, such as `tx: &mut PgConnection`",
        );
        return None;
    };
    if !uses_ident(&item.block, &binding.ident) {
        errors.add(
            binding.ident.span(),
            format_args!(
                "the body never uses `{0}`, so its effects would not be atomic with the \
                 dedup record: run the handler's queries on `{0}` (for example \
                 `.execute(&mut *{0})`) so that they commit or roll back together with it",
                binding.ident.unraw_string()
            ),
        );
        return None;
    }
    Some(Connection {
        pat: (*arg.pat).clone(),
        ty,
        index,
    })
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

/// Whether `ident` appears anywhere in `block`, macro arguments included.
fn uses_ident(block: &syn::Block, ident: &Ident) -> bool {
    fn walk(tokens: TokenStream, name: &str) -> bool {
        tokens.into_iter().any(|tree| match tree {
            TokenTree::Ident(ident) => ident.unraw_string() == name,
            TokenTree::Group(group) => walk(group.stream(), name),
            TokenTree::Punct(_) | TokenTree::Literal(_) => false,
        })
    }
    let name = ident.unraw_string();
    block
        .stmts
        .iter()
        .any(|stmt| walk(quote::ToTokens::to_token_stream(stmt), &name))
}

trait UnrawString {
    fn unraw_string(&self) -> String;
}

impl UnrawString for Ident {
    fn unraw_string(&self) -> String {
        syn::ext::IdentExt::unraw(self).to_string()
    }
}

/// The type with every lifetime replaced by `'static`, for naming its associated
/// `Database` in the generated signature, where `'_` is not allowed.
pub fn with_static_lifetimes(ty: &Type) -> Type {
    struct Static;
    impl VisitMut for Static {
        fn visit_lifetime_mut(&mut self, lifetime: &mut Lifetime) {
            *lifetime = Lifetime::new("'static", lifetime.span());
        }
    }
    let mut ty = ty.clone();
    Static.visit_type_mut(&mut ty);
    ty
}

/// Replaces the first type argument of the `Result` path `ty` with `with`.
pub fn replace_ok(ty: &Type, with: Type) -> Type {
    let mut ty = ty.clone();
    if let Type::Path(TypePath { path, .. }) = &mut ty
        && let Some(last) = path.segments.last_mut()
        && let PathArguments::AngleBracketed(arguments) = &mut last.arguments
        && let Some(first) = arguments
            .args
            .iter_mut()
            .find(|arg| matches!(arg, GenericArgument::Type(_)))
    {
        *first = GenericArgument::Type(with);
    }
    ty
}

/// The first type argument of the `Result` path `ty`.
pub fn ok_type(ty: &Type) -> Option<&Type> {
    let Type::Path(TypePath { path, .. }) = ty else {
        return None;
    };
    let PathArguments::AngleBracketed(arguments) = &path.segments.last()?.arguments else {
        return None;
    };
    arguments.args.iter().find_map(|arg| match arg {
        GenericArgument::Type(ty) => Some(ty),
        _ => None,
    })
}

/// The error type `E` of `Result<T, E>`, when it is written out.
pub fn error_type(ty: &Type) -> Option<&Type> {
    let Type::Path(TypePath { path, .. }) = ty else {
        return None;
    };
    let PathArguments::AngleBracketed(arguments) = &path.segments.last()?.arguments else {
        return None;
    };
    arguments
        .args
        .iter()
        .filter_map(|arg| match arg {
            GenericArgument::Type(ty) => Some(ty),
            _ => None,
        })
        .nth(1)
}
