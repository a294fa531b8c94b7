//! Compile-time misuse of `#[idempotent]`: one misuse per file under `tests/ui/`, each
//! with the reviewed compiler output beside it. Regenerate with `TRYBUILD=overwrite`,
//! then read every changed `.stderr`: is the caret under the user's token, and does the
//! message say what to write instead? Cases with a caller (`*_with_caller.rs`, and a few
//! others) call the handler as users do: the caller must add no error of its own.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
