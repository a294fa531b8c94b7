//! No code: the package holds `tests/ui/`, the compile-fail cases of `#[idempotent]`.
