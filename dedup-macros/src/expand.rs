//! Code generation for `#[idempotent]`, one function per piece.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{AttrStyle, FnArg, Ident, Item, ItemFn, LitStr, Path, ReturnType, Signature, Type};

use crate::args::{self, Args, Effect};
use crate::batch;
use crate::handler::{self, Handler};
use crate::tokens::{key_call, local, respan};
use crate::unawaited;

/// Entry point: parse → validate → expand. On an error, the errors come with a function
/// IDEs and callers can work with: the generated signature when the handler itself was
/// understood (see `placeholder_fn`), so that a caller written against it type-checks and
/// only the real mistake shows; otherwise the user's item as written, and then a caller
/// that expects an `Outcome` fails against it too.
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let (args, mut errors) = args::parse(args);
    let item_fn = match syn::parse2::<Item>(item.clone()) {
        Ok(Item::Fn(item_fn)) => Some(item_fn),
        Ok(other) => {
            errors.add(
                item_keyword_span(&other),
                "`#[idempotent]` applies to an `async fn` handler, such as \
                 `async fn handle(tx: &mut PgConnection, msg: &Msg) -> Result<(), sqlx::Error>`",
            );
            None
        }
        Err(error) => {
            errors.push(error);
            None
        }
    };
    let item_is_fn = item_fn.is_some();
    let key = args.key.as_ref().map(|(_, key)| key);
    let handler = item_fn.and_then(|item_fn| {
        handler::analyze(
            item_fn,
            key,
            args.effect_named,
            args.lease_ms.is_some() || args.lease_named,
            args.batch_named,
            &mut errors,
        )
    });
    if args.batch_named {
        return batch_handler(&args, handler, item, item_is_fn, errors);
    }
    let result = errors.finish();
    let mut tokens = match (&result, handler) {
        (Ok(()), Some(handler)) => return guarded_handler_fn(&args, handler),
        (Err(_), Some(handler)) if args.krate_known => {
            placeholder_fn(&args.krate, handler, args.result_named)
        }
        // No connection or return type to build the signature from, or no path to the
        // runtime to name it with: the user's item as written, allowing the warnings its
        // unexpanded form may raise (an unused connection parameter).
        _ if item_is_fn => quote!(#[allow(unused_variables, dead_code)] #item),
        _ => item,
    };
    if let Err(error) = result {
        tokens.extend(error.to_compile_error());
    }
    tokens
}

/// [`idempotent`] for the batch form (`batch = …`): the generated function, or the errors
/// with a placeholder, as for a single handler.
fn batch_handler(
    args: &Args,
    handler: Option<Handler>,
    item: TokenStream,
    item_is_fn: bool,
    mut errors: args::Errors,
) -> TokenStream {
    let batch = match (handler, &args.batch) {
        (Some(handler), Some(name)) => batch::analyze(handler, name, &args.krate, &mut errors),
        _ => None,
    };
    let result = errors.finish();
    let mut tokens = match (&result, batch) {
        (Ok(()), Some(batch)) => {
            let conn_ty = batch.connection_type().clone();
            let placeholder = batch::placeholder(args, &batch);
            return guarded(args, &conn_ty, batch::expand(args, batch), placeholder);
        }
        (Err(_), Some(batch)) if args.krate_known => batch::placeholder(args, &batch),
        _ if item_is_fn => quote!(#[allow(unused_variables, dead_code)] #item),
        _ => item,
    };
    if let Err(error) = result {
        tokens.extend(error.to_compile_error());
    }
    tokens
}

/// Where to point when the attribute sits on something that is not a function.
fn item_keyword_span(item: &Item) -> Span {
    match item {
        Item::Struct(item) => item.struct_token.span,
        Item::Enum(item) => item.enum_token.span,
        Item::Impl(item) => item.impl_token.span,
        Item::Mod(item) => item.mod_token.span,
        Item::Trait(item) => item.trait_token.span,
        Item::Const(item) => item.const_token.span,
        Item::Static(item) => item.static_token.span,
        Item::Type(item) => item.type_token.span,
        Item::Use(item) => item.use_token.span,
        other => other.span(),
    }
}

// Input:
//     #[idempotent(consumer = "c", key = msg.id)]
//     async fn h(tx: &mut PgConnection, msg: &Msg) -> Result<T, E> { body }
// Output:
//     async fn h(db: impl Db<'_, Postgres>, msg: &Msg) -> Result<Outcome<T>, E> {
//         <key → validated id; claim, body, commit in one transaction; retries>
//     }
fn handler_fn(args: &Args, handler: Handler) -> TokenStream {
    let Handler {
        item,
        connection,
        output,
        retried,
        leased,
    } = handler;
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = item;
    let new_sig = signature(
        &args.krate,
        &sig,
        &connection,
        &output,
        leased,
        args.result_named,
    );
    let outer = attrs
        .iter()
        .filter(|attr| matches!(attr.style, AttrStyle::Outer));
    let inner = attrs
        .iter()
        .filter(|attr| !matches!(attr.style, AttrStyle::Outer));
    let (retryable, body) = match args.lease_ms {
        // The body of a leased call runs once, outside any retry loop.
        Some(lease_ms) if leased => (
            TokenStream::new(),
            leased_body(
                args,
                &sig.ident,
                &connection,
                &output,
                &block.stmts,
                lease_ms,
            ),
        ),
        _ => (
            retryable(&retried),
            body(
                args,
                &sig.ident,
                &connection,
                &output,
                &block.stmts,
                retried.at,
            ),
        ),
    };
    quote! {
        #(#outer)*
        #vis #new_sig {
            #(#inner)*
            #retryable
            #body
        }
    }
}

// Input: a handler on `PgConnection` (or another connection type that names its backend).
// Output: the handler, behind the runtime's guard for that backend's feature:
//     __private::backend_postgres! { { <the handler> } { <feature_placeholder> } }
// With the feature it is the handler; without it, one error naming the feature
// (`dedup-runtime/src/features.rs`) instead of a dozen about the connection type.
fn guarded_handler_fn(args: &Args, handler: Handler) -> TokenStream {
    if handler::backend(&handler.connection.ty).is_none() {
        return handler_fn(args, handler);
    }
    let placeholder = feature_placeholder(&args.krate, &handler, args.result_named);
    let conn_ty = handler.connection.ty.clone();
    guarded(args, &conn_ty, handler_fn(args, handler), placeholder)
}

/// `handler` behind the guard of the backend `conn_ty` names, `placeholder` in its place
/// when the runtime lacks that backend's feature.
fn guarded(
    args: &Args,
    conn_ty: &Type,
    handler: TokenStream,
    placeholder: TokenStream,
) -> TokenStream {
    let Some(backend) = handler::backend(conn_ty) else {
        return handler;
    };
    let at = conn_ty.span();
    let krate = &args.krate;
    let guard = Ident::new(&format!("backend_{backend}"), at);
    let path = respan(quote!(#krate::__private::#guard), at);
    quote! {
        #path! { { #handler } { #placeholder } }
    }
}

// Input: `async fn h(tx: &mut PgConnection, msg: &Msg) -> Result<T, E> { body }`.
// Output: what stands in for it when the backend's feature is off, so that its callers
// type-check and the missing feature is the only error:
//     #[allow(unused_variables, …)]
//     async fn h(__dedup_db: impl Sized, msg: &Msg) -> Result<Outcome<T>, E> { unreachable!() }
fn feature_placeholder(krate: &Path, handler: &Handler, stored: bool) -> TokenStream {
    let ItemFn {
        attrs, vis, sig, ..
    } = &handler.item;
    let conn_ty = &handler.connection.ty;
    let outer = attrs
        .iter()
        .filter(|attr| matches!(attr.style, AttrStyle::Outer));
    let mut new_sig = sig.clone();
    let db = local("__dedup_db");
    if let Some(arg) = new_sig.inputs.iter_mut().nth(handler.connection.index) {
        *arg = FnArg::Typed(syn::parse_quote!(#db: impl ::core::marker::Sized));
    }
    let outcome_ty = outcome_type(krate, &handler.output, handler.leased, stored);
    let arrow = match &sig.output {
        ReturnType::Type(arrow, _) => *arrow,
        ReturnType::Default => syn::Token![->](sig.ident.span()),
    };
    new_sig.output = ReturnType::Type(
        arrow,
        Box::new(handler::replace_ok(&handler.output.ty, outcome_ty)),
    );
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

// Input: the handler's signature,
//     async fn h(tx: &mut PgConnection, msg: &Msg) -> Result<T, E>
// Output: the signature callers see, of the generated function and of the placeholder:
//     async fn h(
//         __dedup_db: impl Db<'_, <PgConnection as HandlerConnection<'static>>::Database>,
//         msg: &Msg,
//     ) -> Result<Outcome<T>, E>
fn signature(
    krate: &Path,
    sig: &Signature,
    connection: &handler::Connection,
    output: &handler::Output,
    leased: bool,
    stored: bool,
) -> Signature {
    let private = quote!(#krate::__private);
    let db = local("__dedup_db");
    let mut new_sig = sig.clone();
    let conn_static = handler::with_static_lifetimes(&connection.ty);
    if leased && let Some(arg) = new_sig.inputs.iter_mut().nth(connection.index) {
        // A leased call takes the pool: its claim, its body and its completion each take
        // a connection of their own, and none is held during the call.
        let pool = respan(quote!(#private::Pool), connection.ty.span());
        let projection = respan(quote!(#private::LeaseParam), connection.ty.span());
        *arg = FnArg::Typed(syn::parse_quote! {
            #db: &#pool<<#conn_static as #projection>::Database>
        });
    } else if let Some(arg) = new_sig.inputs.iter_mut().nth(connection.index) {
        let bound = respan(quote!(#private::Db), connection.ty.span());
        let projection = respan(quote!(#private::HandlerConnection), connection.ty.span());
        *arg = FnArg::Typed(syn::parse_quote! {
            #db: impl #bound<'_, <#conn_static as #projection<'static>>::Database>
        });
    }
    let outcome_ty = outcome_type(krate, output, leased, stored);
    let arrow = match &sig.output {
        ReturnType::Type(arrow, _) => *arrow,
        ReturnType::Default => syn::Token![->](sig.ident.span()),
    };
    new_sig.output = ReturnType::Type(arrow, Box::new(handler::replace_ok(&output.ty, outcome_ty)));
    new_sig
}

// Output: `Outcome<T>` for `Result<T, E>`, `LeaseOutcome<T>` for a leased handler,
// `StoredOutcome<T>` for one with `result = "stored"`.
fn outcome_type(krate: &Path, output: &handler::Output, leased: bool, stored: bool) -> Type {
    let ok = handler::ok_type(&output.ty).cloned();
    if stored {
        syn::parse_quote!(#krate::StoredOutcome<#ok>)
    } else if leased {
        syn::parse_quote!(#krate::LeaseOutcome<#ok>)
    } else {
        syn::parse_quote!(#krate::Outcome<#ok>)
    }
}

// Input: a handler that was understood, while the attribute or the handler has an error
// (`consumer = ""`, a body that never uses its connection, a missing `async`):
//     async fn h(tx: &mut PgConnection, msg: &Msg) -> Result<T, E> { body }
// Output: the generated signature over a body that never runs, emitted next to the error:
//     #[allow(unused_variables, unreachable_code, …)]
//     async fn h(__dedup_db: impl Db<'_, …>, msg: &Msg) -> Result<Outcome<T>, E> {
//         let __dedup_body = async |tx: &mut PgConnection| { <fake return> body };
//         match __dedup_body(::core::unreachable!()).await {
//             Ok(__dedup_value) => Ok(Outcome::Processed(__dedup_value)),
//             Err(__dedup_error) => Err(__dedup_error),
//         }
//     }
// Callers type-check against the function they will get, so the error is the only one. The
// body is still checked (its own mistakes show at once, and its imports count as used), and
// the call that never happens gives an `impl Trait` in `T` its hidden type.
fn placeholder_fn(krate: &Path, handler: Handler, stored: bool) -> TokenStream {
    let Handler {
        item,
        connection,
        output,
        leased,
        ..
    } = handler;
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
        ..
    } = item;
    let mut new_sig = signature(krate, &sig, &connection, &output, leased, stored);
    let processed = if stored {
        quote!(#krate::StoredOutcome::Processed)
    } else if leased {
        quote!(#krate::LeaseOutcome::Processed)
    } else {
        quote!(#krate::Outcome::Processed)
    };
    // A handler without `async` has been reported; its callers `.await` it all the same.
    new_sig
        .asyncness
        .get_or_insert_with(|| syn::Token![async](sig.fn_token.span));
    let outer = attrs
        .iter()
        .filter(|attr| matches!(attr.style, AttrStyle::Outer));
    let inner = attrs
        .iter()
        .filter(|attr| !matches!(attr.style, AttrStyle::Outer));
    let (conn_pat, conn_ty) = (&connection.pat, &connection.ty);
    let fake_return = fake_return(&output);
    let stmts = &block.stmts;
    let (body, value, error) = (
        local("__dedup_body"),
        local("__dedup_value"),
        local("__dedup_error"),
    );
    quote! {
        #(#outer)*
        #[allow(
            unused_variables,
            unreachable_code,
            dead_code,
            clippy::unreachable,
            clippy::diverging_sub_expression
        )]
        #vis #new_sig {
            #(#inner)*
            let #body = async |#conn_pat: &mut #conn_ty| {
                #fake_return
                #(#stmts)*
            };
            match #body(::core::unreachable!()).await {
                ::core::result::Result::Ok(#value) => {
                    ::core::result::Result::Ok(#processed(#value))
                }
                ::core::result::Result::Err(#error) => ::core::result::Result::Err(#error),
            }
        }
    }
}

// Input: the handler's statements.
// Output: the loop that runs claim → body → commit, retried on transient failures, and
// the single place where a `sqlx::Error` of ours becomes the handler's `E`. The whole
// expansion of a handler, which `handler_fn`, `body`, `attempt`, `retryable` and
// `fake_return` build together (`dedup-runtime/src/run.rs` documents each step):
//
//     #[idempotent(consumer = "billing", key = msg.id, unique = "payments_order_key")]
//     async fn mark_paid(tx: &mut PgConnection, msg: &Paid) -> Result<(), sqlx::Error> { body }
//
//     // expands to (paths shortened: `__private::` is `::dedup_runtime::__private::`; the
//     // `__dedup_` locals are mixed-site, invisible to the body):
//     async fn mark_paid(
//         __dedup_db: impl __private::Db<'_, <PgConnection as __private::HandlerConnection<'static>>::Database>,
//         msg: &Paid,
//     ) -> Result<::dedup_runtime::Outcome<()>, sqlx::Error> {
//         trait __DedupRetryable<C, R> { /* see `retryable()` */ }
//         static __DEDUP_METRICS: __private::HandlerMetrics = __private::HandlerMetrics::new();
//         let __dedup_exit = match __private::message_id(&msg.id) {
//             Err(__dedup_error) => {
//                 __private::Exit::Error(__private::refused(&__DEDUP_METRICS, "mark_paid", "billing", __dedup_error))
//             }
//             Ok(__dedup_id) => {
//                 let mut __dedup_run = __private::Run::new(
//                     "mark_paid",
//                     Some(__private::Claim::new(
//                         __private::statements!("processed_messages"),
//                         "billing",
//                         &__dedup_id,
//                     )),
//                     &["payments_order_key"],
//                     &__DEDUP_METRICS,
//                 );
//                 let mut __dedup_handle = __private::Db::into_handle(__dedup_db);
//                 let __dedup_span = __dedup_run.span();
//                 __private::Instrument::instrument(async {
//                     loop {
//                         let mut __dedup_tx = match __dedup_run.begin(&mut __dedup_handle).await {
//                             __private::Begin::Claimed(__dedup_tx) => __dedup_tx,
//                             __private::Begin::Duplicate(__dedup_duplicate) => {
//                                 break __private::Exit::Outcome(Outcome::Duplicate(__dedup_duplicate));
//                             }
//                             __private::Begin::Retry => continue,
//                             __private::Begin::Error(__dedup_error) => break __private::Exit::Error(__dedup_error),
//                         };
//                         let __dedup_result = {
//                             let __dedup_conn: &mut PgConnection =
//                                 <PgConnection as __private::HandlerConnection<'_>>::from_transaction(&mut __dedup_tx);
//                             let __dedup_body = async |tx: &mut PgConnection| {
//                                 if false { let __dedup_fake: Result<(), sqlx::Error> = loop {}; return __dedup_fake; }
//                                 body
//                             };
//                             __DedupRetryable::<_, _>::__dedup_retryable(__dedup_body)(__dedup_conn).await
//                         };
//                         match __dedup_result {
//                             Ok(__dedup_value) => match __dedup_run.commit(__dedup_tx).await {
//                                 __private::Commit::Committed => {
//                                     break __private::Exit::Outcome(Outcome::Processed(__dedup_value));
//                                 }
//                                 __private::Commit::Retry => continue,
//                                 __private::Commit::Error(__dedup_error) => break __private::Exit::Error(__dedup_error),
//                             },
//                             Err(__dedup_error) => match __dedup_run.abort(__dedup_tx, __private::probe!(&__dedup_error)).await {
//                                 __private::Abort::Duplicate(__dedup_duplicate) => {
//                                     break __private::Exit::Outcome(Outcome::Duplicate(__dedup_duplicate));
//                                 }
//                                 __private::Abort::Retry => continue,
//                                 __private::Abort::BodyError => break __private::Exit::BodyError(__dedup_error),
//                             },
//                         }
//                     }
//                 }, __dedup_span).await
//             }
//         };
//         match __dedup_exit {
//             __private::Exit::Outcome(__dedup_value) => Ok(__dedup_value),
//             __private::Exit::BodyError(__dedup_error) => Err(__dedup_error),
//             __private::Exit::Error(__dedup_error) => Err(__private::into_handler_error(__dedup_error)),
//         }
//     }
//
// With `effect = "send-first"` two things differ, and nothing else:
//
//     let mut __dedup_run = __private::Run::new("send_receipt", Some(…), &[]).send_first();
//     let __dedup_body = async |#[allow(unused_variables)] tx: &mut PgConnection| { … };
//
// `send_first()` makes `commit` and `abort` end the call instead of answering `Retry`
// once the body ran (it may have called out: a second run would call again), and the
// body may leave its connection unused. A handler without `effect` expands as above.
fn body(
    args: &Args,
    name: &Ident,
    connection: &handler::Connection,
    output: &handler::Output,
    stmts: &[syn::Stmt],
    at: Span,
) -> TokenStream {
    let krate = &args.krate;
    let private = quote!(#krate::__private);
    let (db, id, handle, run, span, tx, result, exit, value, error, duplicate) = (
        local("__dedup_db"),
        local("__dedup_id"),
        local("__dedup_handle"),
        local("__dedup_run"),
        local("__dedup_span"),
        local("__dedup_tx"),
        local("__dedup_result"),
        local("__dedup_exit"),
        local("__dedup_value"),
        local("__dedup_error"),
        local("__dedup_duplicate"),
    );
    let table = &args.table;
    let handler_name = LitStr::new(&name.to_string(), name.span());
    let unique = &args.unique;
    let attempt = attempt(
        &private,
        connection,
        output,
        stmts,
        &tx,
        at,
        args.effect_named,
    );
    // `effect = "send-first"`: the body may call out, so it never runs twice (run.rs).
    let policy = match args.effect {
        Some(Effect::SendFirst) => quote!(.send_first()),
        // Mark-first always runs under a lease (`leased_body`).
        Some(Effect::MarkFirst) | None => TokenStream::new(),
    };
    // `result = "stored"`: `StoredOutcome<T>`, the result kept for the commit to store
    // and replayed to a duplicate; `fingerprint = …`: hashed once, before the claim.
    let Remembering {
        outcome,
        setup: remembered,
        take_codec,
        keep_result,
        codec,
    } = remembering(
        args,
        &private,
        &run,
        &value,
        output,
        quote!(#krate::Outcome),
    );
    let on_duplicate = if args.stored.is_some() {
        quote!(#run.replay(#duplicate, #codec))
    } else {
        quote!(#private::Exit::Outcome(#outcome::Duplicate(#duplicate)))
    };
    let into_error = {
        let at = handler::error_type(&output.ty).map_or_else(|| output.ty.span(), Spanned::span);
        // The whole call spanned at `E`, so that a missing `From<sqlx::Error>` points there.
        respan(quote!(#private::into_handler_error(#error)), at)
    };

    // Two handlers on one consumer name share one id space: said once per handler, in
    // debug builds (`dedup-runtime/src/consumers.rs`). The handle names the database.
    let registration = args
        .consumer
        .as_ref()
        .filter(|_| args.key.is_some())
        .map(|consumer| {
            let registered = local("__DEDUP_REGISTERED");
            quote! {
                #[cfg(debug_assertions)]
                {
                    static #registered: ::std::sync::Once = ::std::sync::Once::new();
                    #private::register_consumer(
                        &#registered,
                        ::core::concat!(::core::module_path!(), "::", #handler_name),
                        #consumer,
                        #table,
                        &#handle,
                    );
                }
            }
        });
    let consumer_check = args
        .consumer
        .as_ref()
        .map(|consumer| consumer.check(&private))
        .unwrap_or_default();
    let run_loop = quote! {
        #consumer_check
        let mut #handle = #private::Db::into_handle(#db);
        #take_codec
        #registration
        let #span = #run.span();
        #private::Instrument::instrument(async {
            loop {
                let mut #tx = match #run.begin(&mut #handle).await {
                    #private::Begin::Claimed(#tx) => #tx,
                    #private::Begin::Duplicate(#duplicate) => {
                        break #on_duplicate;
                    }
                    #private::Begin::Retry => continue,
                    #private::Begin::Error(#error) => break #private::Exit::Error(#error),
                };
                let #result = { #attempt };
                match #result {
                    ::core::result::Result::Ok(#value) => {
                        #keep_result
                        match #run.commit(#tx).await {
                            #private::Commit::Committed => {
                                break #private::Exit::Outcome(#outcome::Processed(#value));
                            }
                            #private::Commit::Retry => continue,
                            #private::Commit::Error(#error) => break #private::Exit::Error(#error),
                        }
                    }
                    ::core::result::Result::Err(#error) => {
                        match #run.abort(#tx, #private::probe!(&#error)).await {
                            #private::Abort::Duplicate(#duplicate) => {
                                break #private::Exit::Outcome(#outcome::Duplicate(#duplicate));
                            }
                            #private::Abort::Retry => continue,
                            #private::Abort::BodyError => break #private::Exit::BodyError(#error),
                        }
                    }
                }
            }
        }, #span).await
    };
    // With `key = …`, the id is checked before anything runs; with `unique = …` alone
    // there is no id.
    let metrics = local("__DEDUP_METRICS");
    let exit_value = match (&args.key, &args.consumer) {
        (Some((_, key)), Some(consumer)) => {
            let message_id = key_call(&private, "message_id", key);
            quote! {
                match #message_id {
                    ::core::result::Result::Err(#error) => #private::Exit::Error(
                        #private::refused(&#metrics, #handler_name, #consumer, #error),
                    ),
                    ::core::result::Result::Ok(#id) => {
                        let mut #run = #private::Run::new(
                            #handler_name,
                            ::core::option::Option::Some(#private::Claim::new(
                                #private::statements!(#table),
                                #consumer,
                                &#id,
                            )),
                            &[#(#unique),*],
                            &#metrics,
                        )#policy #remembered;
                        #run_loop
                    }
                }
            }
        }
        _ => quote! {{
            let mut #run = #private::Run::new(
                #handler_name,
                ::core::option::Option::None,
                &[#(#unique),*],
                &#metrics,
            )#policy;
            #run_loop
        }},
    };

    quote! {
        // The handler's metric keys, built at its first call (empty without the runtime's
        // `metrics` feature).
        static #metrics: #private::HandlerMetrics = #private::HandlerMetrics::new();
        let #exit = #exit_value;
        match #exit {
            #private::Exit::Outcome(#value) => ::core::result::Result::Ok(#value),
            #private::Exit::BodyError(#error) => ::core::result::Result::Err(#error),
            #private::Exit::Error(#error) => ::core::result::Result::Err(#into_error),
        }
    }
}

/// The pieces of `result = "stored"` and `fingerprint = …` in a handler's expansion.
struct Remembering {
    /// The outcome type's path: `StoredOutcome` with a stored result, else `plain`.
    outcome: TokenStream,
    /// `.store_results(version, max_len)` and `.fingerprint(…)` on the run.
    setup: TokenStream,
    /// `let __dedup_codec = codec();`, spanned at `T`.
    take_codec: Option<TokenStream>,
    /// `__dedup_run.keep_result(&__dedup_value, __dedup_codec);` before the commit.
    keep_result: Option<TokenStream>,
    codec: Ident,
}

// Input: `result = "stored", result_version = 2, fingerprint = msg.body` and the run.
// Output:
//     __private::Run::new(…).store_results(2, 4194304).fingerprint(__private::fingerprint(&msg.body));
//     let __dedup_codec = __private::codec();                 // spanned at `T`
//     … Ok(v) => { __dedup_run.keep_result(&v, __dedup_codec); <commit> } …
// `T`'s codec is taken once where `T: Storable` is required, so that a result type that
// cannot be stored is one error, under `T`.
fn remembering(
    args: &Args,
    private: &TokenStream,
    run: &Ident,
    value: &Ident,
    output: &handler::Output,
    plain: TokenStream,
) -> Remembering {
    let krate = &args.krate;
    let codec = local("__dedup_codec");
    let mut setup = TokenStream::new();
    if let Some(stored) = args.stored {
        let (version, max_len) = (stored.version, stored.max_len);
        setup.extend(quote!(.store_results(#version, #max_len)));
    }
    if let Some(fingerprint) = &args.fingerprint {
        let call = key_call(private, "fingerprint", fingerprint);
        setup.extend(quote!(.fingerprint(#call)));
    }
    let take_codec = args.stored.map(|_| {
        let at = handler::ok_type(&output.ty).map_or_else(|| output.ty.span(), Spanned::span);
        let call = respan(quote!(#private::codec()), at);
        quote!(let #codec = #call;)
    });
    Remembering {
        outcome: if args.stored.is_some() {
            quote!(#krate::StoredOutcome)
        } else {
            plain
        },
        setup,
        take_codec,
        keep_result: args
            .stored
            .map(|_| quote!(#run.keep_result(&#value, #codec);)),
        codec,
    }
}

// Input: a leased handler,
//     #[idempotent(consumer = "charges", key = msg.id, effect = "send-first", lease = "30s")]
//     async fn charge(lease: &mut Lease<'_, Postgres>, msg: &Charge) -> Result<T, E> { body }
// Output (paths shortened as in `body`; `dedup-runtime/src/lease.rs` documents each step):
//     async fn charge(__dedup_db: &__private::Pool<Postgres>, msg: &Charge)
//         -> Result<LeaseOutcome<T>, E>
//     {
//         static __DEDUP_METRICS: __private::HandlerMetrics = …;
//         let __dedup_exit = match __private::message_id(&msg.id) {
//             Err(e) => __private::Exit::Error(__private::refused(…)),
//             Ok(__dedup_id) => {
//                 let mut __dedup_run = __private::LeaseRun::new("charge", __private::LeaseClaim::new(
//                     __private::lease_statements!("processed_messages"), "charges", &__dedup_id,
//                     __private::LeasePolicy::SendFirst, 30000), &__DEDUP_METRICS);
//                 instrument(async {
//                     match __dedup_run.begin(__dedup_db).await {       // claim committed
//                         LeaseBegin::Owned(mut __dedup_lease) => {
//                             let __dedup_body = async |lease: &mut Lease<'_, Postgres>| { body };
//                             match __dedup_body(&mut __dedup_lease).await {  // no transaction open
//                                 Ok(v) => match __dedup_run.complete(__dedup_lease).await {
//                                     Ok(()) => Exit::Outcome(LeaseOutcome::Processed(v)),
//                                     Err(e) => Exit::Error(e),        // never run again
//                                 },
//                                 Err(e) => { __dedup_run.release(__dedup_lease).await; Exit::BodyError(e) }
//                             }
//                         }
//                         LeaseBegin::Outcome(o) => Exit::Outcome(o.widen()), // duplicate, in progress
//                         LeaseBegin::Error(e) => Exit::Error(e),
//                     }
//                 }, span).await
//             }
//         };
//         <the exit, as in `body`>
//     }
fn leased_body(
    args: &Args,
    name: &Ident,
    connection: &handler::Connection,
    output: &handler::Output,
    stmts: &[syn::Stmt],
    lease_ms: u64,
) -> TokenStream {
    let krate = &args.krate;
    let private = quote!(#krate::__private);
    let (db, id, run, span, lease, result, exit, value, error, outcome_local, body, metrics) = (
        local("__dedup_db"),
        local("__dedup_id"),
        local("__dedup_run"),
        local("__dedup_span"),
        local("__dedup_lease"),
        local("__dedup_result"),
        local("__dedup_exit"),
        local("__dedup_value"),
        local("__dedup_error"),
        local("__dedup_outcome"),
        local("__dedup_body"),
        local("__DEDUP_METRICS"),
    );
    let table = &args.table;
    let handler_name = LitStr::new(&name.to_string(), name.span());
    let policy = match args.effect {
        Some(Effect::MarkFirst) => quote!(#private::LeasePolicy::MarkFirst),
        _ => quote!(#private::LeasePolicy::SendFirst),
    };
    let into_error = {
        let at = handler::error_type(&output.ty).map_or_else(|| output.ty.span(), Spanned::span);
        respan(quote!(#private::into_handler_error(#error)), at)
    };
    let (Some((_, key)), Some(consumer)) = (&args.key, &args.consumer) else {
        // `effect` without `key` is refused in `args`: nothing to expand.
        return quote!(::core::unreachable!());
    };
    let message_id = key_call(&private, "message_id", key);
    let (conn_pat, conn_ty) = (&connection.pat, &connection.ty);
    let fake_return = fake_return(output);
    let stmts = unawaited::check(&private, stmts);
    let deny = quote_spanned!(Span::call_site()=> #[deny(unused_must_use)]);
    // `result = "stored"`, `fingerprint = …`: as in `body`, in the fenced completion.
    let Remembering {
        outcome,
        setup,
        take_codec,
        keep_result,
        codec,
    } = remembering(
        args,
        &private,
        &run,
        &value,
        output,
        quote!(#krate::LeaseOutcome),
    );
    let on_outcome = if args.stored.is_some() {
        quote!(#run.replay(#outcome_local, #codec))
    } else {
        quote!(#private::Exit::Outcome(#outcome_local.widen()))
    };
    let consumer_check = consumer.check(&private);
    quote! {
        #consumer_check
        static #metrics: #private::HandlerMetrics = #private::HandlerMetrics::new();
        let #exit = match #message_id {
            ::core::result::Result::Err(#error) => #private::Exit::Error(
                #private::refused(&#metrics, #handler_name, #consumer, #error),
            ),
            ::core::result::Result::Ok(#id) => {
                let mut #run = #private::LeaseRun::new(
                    #handler_name,
                    #private::LeaseClaim::new(
                        #private::lease_statements!(#table),
                        #consumer,
                        &#id,
                        #policy,
                        #lease_ms,
                    ),
                    &#metrics,
                )#setup;
                #take_codec
                let #span = #run.span();
                #private::Instrument::instrument(async {
                    match #run.begin(#db).await {
                        #private::LeaseBegin::Owned(mut #lease) => {
                            let #result = {
                                #deny
                                let #body = async |#[allow(unused_variables)] #conn_pat: &mut #conn_ty| {
                                    #fake_return
                                    #(#stmts)*
                                };
                                #body(&mut #lease).await
                            };
                            match #result {
                                ::core::result::Result::Ok(#value) => {
                                    #keep_result
                                    match #run.complete(#lease).await {
                                        ::core::result::Result::Ok(()) => #private::Exit::Outcome(
                                            #outcome::Processed(#value),
                                        ),
                                        ::core::result::Result::Err(#error) => {
                                            #private::Exit::Error(#error)
                                        }
                                    }
                                }
                                ::core::result::Result::Err(#error) => {
                                    #run.release(#lease).await;
                                    #private::Exit::BodyError(#error)
                                }
                            }
                        }
                        #private::LeaseBegin::Outcome(#outcome_local) => {
                            #on_outcome
                        }
                        #private::LeaseBegin::Error(#error) => #private::Exit::Error(#error),
                    }
                }, #span).await
            }
        };
        match #exit {
            #private::Exit::Outcome(#value) => ::core::result::Result::Ok(#value),
            #private::Exit::BodyError(#error) => ::core::result::Result::Err(#error),
            #private::Exit::Error(#error) => ::core::result::Result::Err(#into_error),
        }
    }
}

// Input: the handler's statements and connection parameter.
// Output: one attempt of the body, on the attempt's transaction `__dedup_tx`:
//     let __dedup_conn: &mut PgConnection = <PgConnection as HandlerConnection<'_>>
//         ::from_transaction(&mut __dedup_tx);
//     let __dedup_body = async |tx: &mut PgConnection| { <fake return> body };
//     __DedupRetryable::<_, _>::__dedup_retryable(__dedup_body)(__dedup_conn).await
// A closure rather than an `async` block in the loop: `__DedupRetryable` asks it to be
// `AsyncFnMut`, so that a body moving out of a parameter fails with that trait's message
// instead of "moved in previous iteration of loop". The connection is the closure's
// argument, so a body may still move it. Only the argument of the check sits on the
// parameter the message names: rustc reports the failed bound there, while everything
// else keeps the call-site span the `async` block had (a connection type that is not one
// then fails at the spans it always did, not once more at that parameter).
fn attempt(
    private: &TokenStream,
    connection: &handler::Connection,
    output: &handler::Output,
    stmts: &[syn::Stmt],
    tx: &Ident,
    at: Span,
    external: bool,
) -> TokenStream {
    let conn_pat = &connection.pat;
    let conn_ty = &connection.ty;
    let conn = local("__dedup_conn");
    let from_transaction = respan(
        quote!(<#conn_ty as #private::HandlerConnection<'_>>::from_transaction),
        conn_ty.span(),
    );
    let fake_return = fake_return(output);
    let body = local("__dedup_body");
    let argument = Ident::new("__dedup_body", Span::mixed_site().located_at(at));
    let check = quote!(__DedupRetryable::<_, _>::__dedup_retryable);
    let stmts = unawaited::check(private, stmts);
    // A future left unawaited in the body is an effect that never happens, under a
    // dedup row that commits: an error, not rustc's warning. A body may still allow
    // the lint where it means it.
    let deny = quote_spanned!(Span::call_site()=> #[deny(unused_must_use)]);
    // A body with an external effect may leave its connection unused: no warning for
    // that parameter alone.
    let unused = external.then(|| quote!(#[allow(unused_variables)]));
    quote! {
        let #conn: &mut #conn_ty = #from_transaction(&mut #tx);
        #deny
        let #body = async |#unused #conn_pat: &mut #conn_ty| {
            #fake_return
            #(#stmts)*
        };
        #check(#argument)(#conn).await
    }
}

// Input: the text of the error for a body that moves out of a parameter.
// Output: a trait the body's closure implements when it can run more than once:
//     #[diagnostic::on_unimplemented(message = "the body of `h` may run more than once…")]
//     trait __DedupRetryable<C, R> { fn __dedup_retryable(self) -> Self { self } }
//     #[diagnostic::do_not_recommend]
//     impl<C, R, F: AsyncFnMut(&mut C) -> R> __DedupRetryable<C, R> for F {}
// Generated inside the handler, so that the message can name its parameters; without
// `do_not_recommend`, rustc would report the closure kind (E0525) instead of this trait.
fn retryable(retried: &handler::Retried) -> TokenStream {
    let escape = |text: &str| {
        LitStr::new(
            &text.replace('{', "{{").replace('}', "}}"),
            Span::call_site(),
        )
    };
    let message = escape(&retried.message);
    let label = escape(&retried.label);
    let notes = retried.notes.iter().map(|note| escape(note));
    quote! {
        #[diagnostic::on_unimplemented(message = #message, label = #label, #(note = #notes),*)]
        trait __DedupRetryable<C: ?::core::marker::Sized, R>: ::core::marker::Sized {
            fn __dedup_retryable(self) -> Self {
                self
            }
        }
        #[diagnostic::do_not_recommend]
        impl<C: ?::core::marker::Sized, R, F: ::core::ops::AsyncFnMut(&mut C) -> R>
            __DedupRetryable<C, R> for F
        {
        }
    }
}

// Input: the return type `Result<T, E>`.
// Output: an unreachable `return` of that type at the top of the body's closure, so
// that `?` and type errors inside the body resolve against the handler's own types.
fn fake_return(output: &handler::Output) -> TokenStream {
    // `impl Trait` cannot be named in a `let`: `_` leaves it to inference, while `E` (which
    // the error probe needs to know) stays pinned.
    let ty = handler::nameable(&output.ty);
    let fake = local("__dedup_fake");
    quote! {
        #[allow(unreachable_code, clippy::diverging_sub_expression, clippy::unreachable)]
        if false {
            let #fake: #ty = loop {};
            return #fake;
        }
    }
}
