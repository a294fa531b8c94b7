//! Reading the handler's types: the backend a connection names, the `T` and `E` of its
//! `Result`, lifetimes made `'static` for a projection. A leaf: it imports nothing of
//! this crate but the token helpers.

use syn::visit_mut::VisitMut;
use syn::{GenericArgument, Lifetime, PathArguments, Type, TypePath};

use crate::tokens::ungrouped_type;

/// The backend a connection type names, as the runtime's feature spells it:
/// `PgConnection` and `Transaction<'_, Postgres>` → `postgres`. `None` for a type that
/// names none (an alias, a type of the user's): the runtime's own errors then speak.
pub fn backend(ty: &Type) -> Option<&'static str> {
    let Type::Path(TypePath { path, .. }) = ungrouped_type(ty) else {
        return None;
    };
    let last = path.segments.last()?;
    let from_database = |name: &str| match name {
        "Postgres" => Some("postgres"),
        "Sqlite" => Some("sqlite"),
        "MySql" => Some("mysql"),
        _ => None,
    };
    match last.ident.to_string().as_str() {
        "PgConnection" => Some("postgres"),
        "SqliteConnection" => Some("sqlite"),
        "MySqlConnection" => Some("mysql"),
        "Transaction" | "Lease" => generic_types(last).find_map(|ty| match ungrouped_type(ty) {
            Type::Path(TypePath { path, .. }) => path
                .segments
                .last()
                .and_then(|last| from_database(&last.ident.to_string())),
            _ => None,
        }),
        _ => None,
    }
}

/// Whether `ty` names `Transaction<…>` (`sqlx::Transaction<'_, Postgres>`).
pub fn names_transaction(ty: &Type) -> bool {
    matches!(ungrouped_type(ty), Type::Path(TypePath { path, .. })
        if path.segments.last().is_some_and(|last| last.ident == "Transaction"))
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

/// The type arguments of `segment` (`Pool<Postgres>` → `Postgres`).
pub(crate) fn generic_types(segment: &syn::PathSegment) -> impl Iterator<Item = &Type> {
    let arguments = match &segment.arguments {
        PathArguments::AngleBracketed(arguments) => Some(arguments.args.iter()),
        _ => None,
    };
    arguments
        .into_iter()
        .flatten()
        .filter_map(|argument| match argument {
            GenericArgument::Type(ty) => Some(ty),
            _ => None,
        })
}
