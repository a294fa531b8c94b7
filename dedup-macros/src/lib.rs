//! The `#[idempotent]` attribute of [dedup](https://docs.rs/dedup-runtime).
//!
//! Depend on `dedup-runtime` and use the attribute through it
//! (`use dedup_runtime::idempotent;`): the generated code calls the runtime, and the
//! runtime's documentation describes the attribute in full.

mod args;
mod expand;
mod handler;
mod unawaited;

use proc_macro::TokenStream;

/// Makes an `async fn` message handler effectively-once.
///
/// See [`dedup_runtime::idempotent`](https://docs.rs/dedup-runtime/latest/dedup_runtime/attr.idempotent.html)
/// for the arguments, the rewritten signature and the equivalent hand-written code.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
