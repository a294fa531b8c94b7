//! `dedup`: see the crate's documentation, or `dedup --help`.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    ExitCode::from(dedup_cli::run(std::env::args_os(), &mut out, &mut err).await)
}
