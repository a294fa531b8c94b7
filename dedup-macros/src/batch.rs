//! The batch form, `#[idempotent(consumer = "billing", batch = orders, key = |order| order.id)]`:
//! what it accepts as a handler, and its expansion onto the runtime's `Batch`.
//!
//! A batch handler is `async fn h(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), E>`:
//! its connection and the messages of the batch not processed before, nothing else (its body
//! becomes a `BatchHandler` impl of a unit struct, which holds no state). The generated
//! function takes `(db, orders: &[Order])` and returns `Result<BatchOutcome<E>, sqlx::Error>`.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{AttrStyle, Expr, FnArg, Ident, ItemFn, LitStr, Pat, Type};

use crate::args::{Args, Errors};
use crate::handler::{self, Handler};
use crate::tokens::{key_call, local, respan, ungrouped_expr, ungrouped_type};
use crate::unawaited;

/// A batch handler the expansion can build on.
pub struct Batch {
    handler: Handler,
    /// The messages' parameter: its binding and `M` of `&[&M]`.
    messages: Ident,
    message_ty: Type,
    /// `E` of `Result<(), E>`, or `<R as __private::ResultType>::Err` for an alias `R`.
    error_ty: Type,
}

/// Checks what the batch form adds to a handler: `batch = orders` names a parameter
/// `orders: &[&M]`, the only one besides the connection; no `self`, no generics (the body
/// moves into an impl of its own); `Result<(), E>`. Returns the parts whenever the
/// signature can be built, even next to errors in the body's use of its parameters.
pub fn analyze(
    handler: Handler,
    batch: &Ident,
    krate: &syn::Path,
    errors: &mut Errors,
) -> Option<Batch> {
    let sig = &handler.item.sig;
    let block_tokens = &handler.item.block;
    let mut ok = true;
    if let Some(receiver) = sig.receiver() {
        errors.add_spanned(
            receiver,
            "a batch handler cannot take `self`: its body runs as a handler of its own, \
             once per transaction; for state (settings, clients), implement \
             `dedup_runtime::batch::BatchHandler` on a struct that holds it and call \
             `Batch::run`",
        );
        ok = false;
    }
    if !sig.generics.params.is_empty() {
        errors.add_spanned(
            &sig.generics.params,
            "a batch handler cannot be generic: name its connection and message types \
             (`tx: &mut PgConnection, orders: &[&Order]`), or implement \
             `dedup_runtime::batch::BatchHandler` for the generic case",
        );
        ok = false;
    }
    if handler::names_transaction(&handler.connection.ty) {
        errors.add_spanned(
            &handler.connection.ty,
            "the body of a batch handler runs on the batch's transaction as a connection: \
             write `&mut PgConnection` (or `SqliteConnection`, `MySqlConnection`)",
        );
        ok = false;
    }
    // The body moves into an impl of its own, where `Self` is another type.
    if let Some(at) = self_type(quote!(#sig #block_tokens)) {
        errors.add(
            at,
            "the body of a batch handler runs in an impl of its own, where `Self` is not \
             your type: write the type's name instead of `Self`",
        );
        ok = false;
    }
    // The parameters after the connection: the messages, and nothing else.
    let others: Vec<&syn::PatType> = sig
        .inputs
        .iter()
        .enumerate()
        .filter(|(index, _)| *index != handler.connection.index)
        .filter_map(|(_, input)| match input {
            FnArg::Typed(arg) => Some(arg),
            FnArg::Receiver(_) => None,
        })
        .collect();
    let named =
        |arg: &&syn::PatType| matches!(&*arg.pat, Pat::Ident(binding) if binding.ident == *batch);
    let Some(arg) = others.iter().copied().find(named) else {
        let hint = match others.as_slice() {
            [only] => match &*only.pat {
                Pat::Ident(binding) => format!("; did you mean `batch = {}`?", binding.ident),
                _ => String::new(),
            },
            _ => {
                format!(": add the messages' parameter, `{batch}: &[&Order]`, after the connection")
            }
        };
        errors.add(
            batch.span(),
            format_args!(
                "`batch = {batch}` names no parameter of `{}`{hint}",
                sig.ident
            ),
        );
        return None;
    };
    for other in others.iter().filter(|other| !named(other)) {
        errors.add_spanned(
            other,
            "a batch handler takes its connection and its messages, nothing else: its body \
             runs once per transaction for the messages that are fresh; for settings or \
             clients, implement `dedup_runtime::batch::BatchHandler` on a struct that holds \
             them and call `Batch::run`",
        );
        ok = false;
    }
    let message_ty = match message_type(&arg.ty) {
        Ok(ty) => ty.clone(),
        Err(written) => {
            errors.add_spanned(
                &arg.ty,
                format_args!(
                    "the body of a batch handler sees the messages not processed before, \
                     each once, borrowed from the caller's slice: write \
                     `{batch}: &[&{written}]`; callers of the generated function pass \
                     `&[{written}]`"
                ),
            );
            return None;
        }
    };
    let output = &handler.output.ty;
    match handler::ok_type(output) {
        Some(Type::Tuple(unit)) if unit.elems.is_empty() => {}
        Some(other) => {
            errors.add_spanned(
                other,
                "the body of a batch handler runs once for many messages and returns no \
                 value per message: write `Result<(), E>`",
            );
            ok = false;
        }
        None => {}
    }
    let error_ty = match handler::error_type(output) {
        Some(error) => error.clone(),
        // An alias such as `anyhow::Result<()>`: its `E`, found by the type checker.
        None => {
            let projection = quote!(<#output as #krate::__private::ResultType>::Err);
            syn::parse2(respan(projection, output.span())).ok()?
        }
    };
    let Pat::Ident(binding) = &*arg.pat else {
        return None;
    };
    let messages = binding.ident.clone();
    ok.then_some(Batch {
        handler,
        messages,
        message_ty,
        error_ty,
    })
}

impl Batch {
    /// The referent of the connection parameter, `PgConnection`.
    pub fn connection_type(&self) -> &Type {
        &self.handler.connection.ty
    }
}

/// The span of the first `Self` in `tokens`, at any depth.
fn self_type(tokens: TokenStream) -> Option<Span> {
    tokens.into_iter().find_map(|tree| match tree {
        proc_macro2::TokenTree::Ident(ident) if ident == "Self" => Some(ident.span()),
        proc_macro2::TokenTree::Group(group) => self_type(group.stream()),
        _ => None,
    })
}

/// `M` of `&[&M]`; otherwise what to show as `M` in the message.
fn message_type(ty: &Type) -> Result<&Type, String> {
    let text = |ty: &Type| quote!(#ty).to_string().replace(" ", "");
    let Type::Reference(outer) = ungrouped_type(ty) else {
        return Err(element_text(ty, &text));
    };
    let Type::Slice(slice) = ungrouped_type(&outer.elem) else {
        return Err(element_text(ty, &text));
    };
    match ungrouped_type(&slice.elem) {
        Type::Reference(inner) if inner.mutability.is_none() && outer.mutability.is_none() => {
            Ok(&inner.elem)
        }
        Type::Reference(inner) => Err(text(&inner.elem)),
        other => Err(text(other)),
    }
}

/// What `M` a wrong messages type probably meant: `Order` of `&[Order]`, `Vec<Order>`.
fn element_text(ty: &Type, text: &dyn Fn(&Type) -> String) -> String {
    match ungrouped_type(ty) {
        Type::Reference(reference) => element_text(&reference.elem, text),
        Type::Slice(slice) => element_text(&slice.elem, text),
        Type::Path(path) => {
            let last = path.path.segments.last();
            match last.map(|last| (&last.ident, &last.arguments)) {
                Some((ident, syn::PathArguments::AngleBracketed(arguments))) if ident == "Vec" => {
                    match arguments.args.first() {
                        Some(syn::GenericArgument::Type(ty)) => element_text(ty, text),
                        _ => "Order".to_owned(),
                    }
                }
                _ => text(ty),
            }
        }
        _ => "Order".to_owned(),
    }
}

// Input:
//     #[idempotent(consumer = "billing", batch = orders, key = |order| order.id)]
//     async fn bill(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), sqlx::Error> { body }
// Output (paths shortened: `__private::` is `::dedup_runtime::__private::`):
//     async fn bill(
//         __dedup_db: impl __private::Db<'_, <PgConnection as __private::HandlerConnection<'static>>::Database>,
//         orders: &[Order],
//     ) -> Result<::dedup_runtime::batch::BatchOutcome<sqlx::Error>, __private::SqlxError> {
//         struct __DedupBody;
//         impl __private::BatchHandler<<PgConnection as …>::Database, Order> for __DedupBody {
//             type Error = sqlx::Error;
//             #[deny(unused_must_use)]
//             async fn handle(&self, tx: &mut PgConnection, orders: &[&Order])
//                 -> Result<(), sqlx::Error> { body }
//         }
//         fn __dedup_key(order: &Order) -> __private::MessageId<'static> {
//             __private::batch_key(&order.id)
//         }
//         // With `fingerprint = |order| order.body`:
//         fn __dedup_print(order: &Order) -> __private::Fingerprint {
//             __private::fingerprint(&order.body)
//         }
//         __private::run_batch(__dedup_db, "billing", "processed_messages", &[], orders,
//             __dedup_key, Some(__dedup_print) /* or None */, &__DedupBody).await
//     }
// The body is spliced once, as the impl's method: `?` and `return` keep their meaning, and
// a type error points into it. `Batch::run` (`dedup-runtime/src/batch.rs`) does the rest.
pub fn expand(args: &Args, batch: Batch) -> TokenStream {
    let krate = &args.krate;
    let private = quote!(#krate::__private);
    let Batch {
        handler,
        messages,
        message_ty,
        error_ty,
        ..
    } = batch;
    let ItemFn {
        attrs, vis, block, ..
    } = &handler.item;
    let outer = attrs
        .iter()
        .filter(|attr| matches!(attr.style, AttrStyle::Outer));
    let inner = attrs
        .iter()
        .filter(|attr| !matches!(attr.style, AttrStyle::Outer));
    let new_sig = signature(args, &handler, &messages, &message_ty, &error_ty);
    let (conn_pat, conn_ty) = (&handler.connection.pat, &handler.connection.ty);
    let database = database(&private, conn_ty);
    let output = &handler.output.ty;
    let stmts = unawaited::check(&private, &block.stmts);
    let deny = quote_spanned!(Span::call_site()=> #[deny(unused_must_use)]);
    let (db, body_ty, key_fn) = (
        local("__dedup_db"),
        Ident::new("__DedupBody", Span::mixed_site()),
        Ident::new("__dedup_key", Span::mixed_site()),
    );
    let (key_pat, key_ty, key_body) =
        closure_parts(args.key.as_ref().map(|(_, key)| key), &message_ty);
    let key_tokens = key_call(&private, "batch_key", &key_body);
    // `fingerprint = |order| order.body`: a function of one message, as for the key.
    let (print_fn, print) = match &args.fingerprint {
        Some(fingerprint) => {
            let print_fn = Ident::new("__dedup_print", Span::mixed_site());
            let (pat, ty, body) = closure_parts(Some(fingerprint), &message_ty);
            let call = key_call(&private, "fingerprint", &body);
            (
                quote! {
                    #[allow(clippy::needless_pass_by_value, clippy::trivially_copy_pass_by_ref)]
                    fn #print_fn(#pat: #ty) -> #private::Fingerprint {
                        #call
                    }
                },
                quote!(::core::option::Option::Some(#print_fn)),
            )
        }
        None => (TokenStream::new(), quote!(::core::option::Option::None)),
    };
    let consumer = args
        .consumer
        .clone()
        .unwrap_or_else(|| crate::args::Consumer::Literal(LitStr::new("", Span::call_site())));
    let consumer_check = args
        .consumer
        .as_ref()
        .map(|consumer| consumer.check(&private))
        .unwrap_or_default();
    let table = &args.table;
    let unique = &args.unique;
    quote! {
        #(#outer)*
        #vis #new_sig {
            #consumer_check
            struct #body_ty;
            impl #private::BatchHandler<#database, #message_ty> for #body_ty {
                type Error = #error_ty;
                #deny
                async fn handle(
                    &self,
                    #conn_pat: &mut #conn_ty,
                    #messages: &[&#message_ty],
                ) -> #output {
                    #(#inner)*
                    #(#stmts)*
                }
            }
            #[allow(clippy::needless_pass_by_value, clippy::trivially_copy_pass_by_ref)]
            fn #key_fn(#key_pat: #key_ty) -> #private::MessageId<'static> {
                #key_tokens
            }
            #print_fn
            #private::run_batch(
                #db,
                #consumer,
                #table,
                &[#(#unique),*],
                #messages,
                #key_fn,
                #print,
                &#body_ty,
            )
            .await
        }
    }
}

/// A closure's (`key = |order| order.id`, `fingerprint = |order| order.body`) parameter,
/// its type (`&M` unless written), and its body.
fn closure_parts(closure: Option<&Expr>, message_ty: &Type) -> (Pat, Type, Expr) {
    let closure = closure.and_then(|closure| match ungrouped_expr(closure) {
        Expr::Closure(closure) => Some(closure.clone()),
        _ => None,
    });
    let Some(closure) = closure else {
        // Refused in `args`; expand to something that type-checks.
        return (
            syn::parse_quote!(_),
            syn::parse_quote!(&#message_ty),
            syn::parse_quote!(""),
        );
    };
    let (pat, ty) = match closure.inputs.first() {
        Some(Pat::Type(typed)) => ((*typed.pat).clone(), (*typed.ty).clone()),
        Some(other) => (other.clone(), syn::parse_quote!(&#message_ty)),
        None => (syn::parse_quote!(_), syn::parse_quote!(&#message_ty)),
    };
    (pat, ty, *closure.body)
}

// Output: `<PgConnection as __private::HandlerConnection<'static>>::Database`.
fn database(private: &TokenStream, conn_ty: &Type) -> TokenStream {
    let conn_static = handler::with_static_lifetimes(conn_ty);
    let projection = respan(quote!(#private::HandlerConnection), conn_ty.span());
    quote!(<#conn_static as #projection<'static>>::Database)
}

// Input: `async fn bill(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), E>`.
// Output: `async fn bill(__dedup_db: impl Db<'_, …>, orders: &[Order])
//     -> Result<BatchOutcome<E>, sqlx::Error>`: what callers see, of the generated function
// and of the placeholder.
fn signature(
    args: &Args,
    handler: &Handler,
    messages: &Ident,
    message_ty: &Type,
    error_ty: &Type,
) -> syn::Signature {
    let krate = &args.krate;
    let private = quote!(#krate::__private);
    let mut sig = handler.item.sig.clone();
    let db = local("__dedup_db");
    let conn_ty = &handler.connection.ty;
    let database = database(&private, conn_ty);
    let bound = respan(quote!(#private::Db), conn_ty.span());
    let mut inputs = syn::punctuated::Punctuated::<FnArg, syn::Token![,]>::new();
    inputs.push(syn::parse_quote!(#db: impl #bound<'_, #database>));
    inputs.push(syn::parse_quote!(#messages: &[#message_ty]));
    sig.inputs = inputs;
    let arrow = match &sig.output {
        syn::ReturnType::Type(arrow, _) => *arrow,
        syn::ReturnType::Default => syn::Token![->](sig.ident.span()),
    };
    let outcome: Type = syn::parse_quote! {
        ::core::result::Result<#krate::batch::BatchOutcome<#error_ty>, #private::SqlxError>
    };
    sig.output = syn::ReturnType::Type(arrow, Box::new(outcome));
    sig.asyncness
        .get_or_insert_with(|| syn::Token![async](sig.fn_token.span));
    sig
}

// Input: a batch handler that was understood, next to an error of the attribute or the body.
// Output: the generated signature over a body that never runs, so that callers type-check
// and the error is the only one:
//     #[allow(unused_variables, …)]
//     async fn bill(__dedup_db: impl Db<'_, …>, orders: &[Order])
//         -> Result<BatchOutcome<E>, sqlx::Error> { ::core::unreachable!() }
pub fn placeholder(args: &Args, batch: &Batch) -> TokenStream {
    let ItemFn { attrs, vis, .. } = &batch.handler.item;
    let outer = attrs
        .iter()
        .filter(|attr| matches!(attr.style, AttrStyle::Outer));
    let new_sig = signature(
        args,
        &batch.handler,
        &batch.messages,
        &batch.message_ty,
        &batch.error_ty,
    );
    let conn_ty = &batch.handler.connection.ty;
    quote! {
        #(#outer)*
        #[allow(unused_variables, unreachable_code, dead_code, clippy::unreachable)]
        #vis #new_sig {
            // Names the connection type, as the handler did (its import stays used).
            let _: ::core::option::Option<&mut #conn_ty> = ::core::option::Option::None;
            ::core::unreachable!()
        }
    }
}
