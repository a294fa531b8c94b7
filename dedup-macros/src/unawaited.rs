//! `let _ = <a future>;` in a handler's body: a statement that compiles without a warning
//! and never runs. `tx.execute(…)` without `.await`, bound to `_`, is a message marked
//! processed whose effect never happened.
//!
//! rustc's `unused_must_use` (which the expansion denies in the body) sees a future left
//! as an expression statement, not one bound to `_`. The macro cannot see types, so it
//! asks the type checker: every `let _ = <call>;` and `_ = <call>;` of the body becomes
//!
//! ```text
//! let _ = match <call> {
//!     __dedup_unawaited => {
//!         {
//!             use __private::unawaited::{FutureCase as _, ValueCase as _};
//!             __private::unawaited::awaited((&__private::unawaited::Probe(&__dedup_unawaited)).__dedup_kind());
//!         }
//!         __dedup_unawaited
//!     }
//! };
//! ```
//!
//! `__dedup_kind` resolves to `FutureCase`'s (whose `IsFuture` fails `awaited`'s bound,
//! with the message that says to `.await` it) when the value is a future, and to
//! `ValueCase`'s through the extra `&` otherwise: method resolution tries the receiver as
//! written before it borrows it again. The value still drops where `let _ =` dropped it,
//! at the end of the statement: a `match` keeps its scrutinee's temporaries that long.
//!
//! Only value expressions are rewritten (calls, method calls, `async` blocks, `.await`,
//! `?`): `let _ = place;` neither moves nor drops `place`, and must stay as written. A
//! `let _: T = …;` is left alone too: the type is written out.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{Expr, Item, Pat, Stmt};

use crate::tokens::respan;

/// The body's statements with every `let _ = <value>;` checked for a dropped future.
pub fn check(private: &TokenStream, stmts: &[Stmt]) -> Vec<Stmt> {
    let mut rewrite = Rewrite { private };
    stmts
        .iter()
        .cloned()
        .map(|mut stmt| {
            rewrite.visit_stmt_mut(&mut stmt);
            stmt
        })
        .collect()
}

struct Rewrite<'a> {
    private: &'a TokenStream,
}

impl Rewrite<'_> {
    fn probe(&self, expr: &mut Expr) {
        let span = expr.span();
        let private = self.private;
        let value = syn::Ident::new("__dedup_unawaited", Span::mixed_site());
        let checked = respan(
            quote! {{
                use #private::unawaited::{FutureCase as _, ValueCase as _};
                #private::unawaited::awaited(
                    (&#private::unawaited::Probe(&#value)).__dedup_kind()
                );
            }},
            span,
        );
        let original = std::mem::replace(expr, Expr::Verbatim(TokenStream::new()));
        *expr = Expr::Verbatim(quote! {
            match #original {
                #value => {
                    #checked
                    #value
                }
            }
        });
    }
}

/// Whether `expr` is a value (a temporary that `let _ =` drops) rather than a place.
fn is_value(expr: &Expr) -> bool {
    match expr {
        Expr::Call(_) | Expr::MethodCall(_) | Expr::Async(_) | Expr::Await(_) | Expr::Try(_) => {
            true
        }
        Expr::Paren(inner) => is_value(&inner.expr),
        _ => false,
    }
}

/// `_`, not `_: T`: a type written out says what the value is (and the check, which
/// needs the value's type before the `let` gives it one, could fail to infer it).
fn is_wild(pat: &Pat) -> bool {
    match pat {
        Pat::Wild(_) => true,
        Pat::Paren(inner) => is_wild(&inner.pat),
        _ => false,
    }
}

impl VisitMut for Rewrite<'_> {
    fn visit_local_mut(&mut self, local: &mut syn::Local) {
        visit_mut::visit_local_mut(self, local);
        if let Some(init) = &mut local.init
            && init.diverge.is_none()
            && is_wild(&local.pat)
            && is_value(&init.expr)
        {
            self.probe(&mut init.expr);
        }
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        visit_mut::visit_expr_mut(self, expr);
        if let Expr::Assign(assign) = expr
            && matches!(*assign.left, Expr::Infer(_))
            && is_value(&assign.right)
        {
            self.probe(&mut assign.right);
        }
    }

    // A function, impl or module inside the body is not the body.
    fn visit_item_mut(&mut self, _: &mut Item) {}
}
