//! Logging through `tracing`, with the level from `RUCX_LOG_LEVEL`.

use std::sync::Once;

static INIT: Once = Once::new();

/// Install a stderr subscriber once per process, at the level named by `RUCX_LOG_LEVEL`
/// (`error`, `warn` (default), `info`, `debug`, `trace`, or any `tracing` filter directive).
/// Does nothing if the application already installed a subscriber.
pub fn init() {
    INIT.call_once(|| {
        let level = std::env::var("RUCX_LOG_LEVEL").unwrap_or_else(|_| "warn".into());
        let filter = tracing_subscriber::EnvFilter::try_new(&level)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .try_init();
    });
}
