//! The `#[idempotent]` attribute of dedup, for use through `dedup-runtime`.
//!
//! Depend on `dedup-runtime` and write `use dedup_runtime::idempotent;`: the generated
//! code calls the runtime, and the attribute's documentation is
//! [`dedup_runtime::idempotent`](https://docs.rs/dedup-runtime/latest/dedup_runtime/attr.idempotent.html).

#![deny(missing_docs)]

mod args;
mod batch;
mod expand;
mod handler;
mod tokens;
mod types;
mod unawaited;

use proc_macro::TokenStream;

// No doc comment here, on purpose: rustdoc appends an inlined item's own docs to those of
// its re-export, so any text here would end the page of `dedup_runtime::idempotent`, the
// one users read. The crate's doc above points there. (So the crate's `deny(missing_docs)`
// is lifted for this one item, documented where it is read.)
#[allow(missing_docs)]
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
