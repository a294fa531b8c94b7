// `AckPolicy::decide` on an `anyhow::Result` handler's result: anyhow's error is not an
// `std::error::Error` itself (it holds one), so the call to write is `decide_dyn`.
use dedup_runtime::{AckPolicy, Outcome};

fn main() {
    let result: anyhow::Result<Outcome<()>> = Err(anyhow::anyhow!("payment provider down"));
    let _ = AckPolicy::<sqlx::Postgres>::new().decide(&result, 1);
}
