//! `rgpu-broker`: see `rgpu-broker --help`.

use std::process::ExitCode;

use rgpu_config::Settings as _;
use rgpu_pool_broker::config::{Config, Settings};

fn main() -> ExitCode {
    // Before logging starts: `--help` and bad flags print and exit here.
    let loaded = Settings::from_process().unwrap_or_else(|e| e.exit());
    let filter = tracing_subscriber::EnvFilter::try_from_env("RGPU_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    let result = Config::load(loaded).and_then(rgpu_pool_broker::run);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
