//! Logging inside a user's program: to stderr, off unless RGPU_LOG asks,
//! except warnings and errors.

use std::sync::Once;

pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("RGPU_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        // The program may have its own subscriber; ours is only a default.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false)
            .try_init();
    });
}
