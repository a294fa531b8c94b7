//! Token helpers every expansion shares: spans moved onto the user's tokens, our own
//! hygienic locals, the key's call, and what a `macro_rules!` macro's invisible groups
//! hide. A leaf: it imports nothing of this crate.

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote};
use syn::{Expr, Type};

/// `tokens` with every span moved to `at`, keeping mixed-site hygiene: for generated
/// code whose type errors should point at the user's token that caused them. (Tokens
/// interpolated into `quote_spanned!` keep their own spans, so that is not enough.)
pub(crate) fn respan(tokens: TokenStream, at: Span) -> TokenStream {
    let span = Span::mixed_site().located_at(at);
    tokens
        .into_iter()
        .map(|tree| match tree {
            TokenTree::Group(group) => {
                let mut new = Group::new(group.delimiter(), respan(group.stream(), at));
                new.set_span(span);
                TokenTree::Group(new)
            }
            mut other => {
                other.set_span(span);
                other
            }
        })
        .collect()
}

/// The first and last token spans of `tokens`: the caret of an error that should cover
/// them all (stable proc macros cannot join spans).
fn first_and_last(tokens: &impl ToTokens) -> (Span, Span) {
    let mut spans = tokens.to_token_stream().into_iter().map(|tree| tree.span());
    let first = spans.next().unwrap_or_else(Span::call_site);
    (first, spans.last().unwrap_or(first))
}

// Input: `key = msg.id`, and the runtime's function to call, `message_id`.
// Output: `message_id(&msg.id)`, spanned so that an error on the key's type points at
// exactly the key (parenthesised only where `&` would bind differently).
pub(crate) fn key_call(private: &TokenStream, function: &str, key: &syn::Expr) -> TokenStream {
    use syn::Expr;
    let (first, last) = first_and_last(key);
    let function = Ident::new(function, Span::call_site());
    let path = respan(quote!(#private::#function), first);
    let borrow = respan(quote!(&), first);
    let needs_parens = !matches!(
        key,
        Expr::Path(_)
            | Expr::Field(_)
            | Expr::MethodCall(_)
            | Expr::Call(_)
            | Expr::Index(_)
            | Expr::Lit(_)
            | Expr::Paren(_)
            | Expr::Macro(_)
    );
    let key = if needs_parens {
        let mut group = Group::new(Delimiter::Parenthesis, key.to_token_stream());
        group.set_span(Span::mixed_site().located_at(first));
        group.into_token_stream()
    } else {
        key.to_token_stream()
    };
    let mut arguments = Group::new(Delimiter::Parenthesis, quote!(#borrow #key));
    arguments.set_span(Span::mixed_site().located_at(last));
    quote!(#path #arguments)
}

/// Our own locals: mixed-site hygiene, so that neither the body nor a `use` inside it can
/// see or shadow them.
pub(crate) fn local(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

/// `expr` without the invisible group around a `$name:expr` (or `$name:literal`) that a
/// `macro_rules!` macro forwards to the attribute.
pub(crate) fn ungrouped_expr(expr: &Expr) -> &Expr {
    match expr {
        Expr::Group(group) => ungrouped_expr(&group.expr),
        other => other,
    }
}

/// `ty` without the invisible group around a `$name:ty` that a `macro_rules!` macro
/// forwards, nor parentheses.
pub(crate) fn ungrouped_type(ty: &Type) -> &Type {
    match ty {
        Type::Group(group) => ungrouped_type(&group.elem),
        Type::Paren(paren) => ungrouped_type(&paren.elem),
        other => other,
    }
}
