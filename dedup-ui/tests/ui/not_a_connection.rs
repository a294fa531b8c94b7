// Several errors for one mistake, and no way to one: `String` is a path, and a path may
// name a connection through an alias (`type Conn = PgConnection;`), so the macro cannot
// refuse it and leaves it to rustc (types no alias can name, such as `&mut &mut
// PgConnection`, are refused by the macro: `connection_borrowed_twice.rs`). rustc reports
// the unmet `HandlerConnection` bound once for each place of the generated function that
// needs it: the parameter `impl Db<'_, <String as HandlerConnection>::Database>`, the
// return type (its future captures that parameter), the function as a whole, and the body's
// view of the connection (`HandlerConnection<'_>`). Each error names the same fix.
use dedup_runtime::idempotent;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut String, id: &str) -> Result<(), sqlx::Error> {
    tx.push_str(id);
    Ok(())
}

fn main() {}
