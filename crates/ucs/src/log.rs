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
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init();
    });
}

/// Options of the services layer (read directly by [`init`], declared here so that
/// `rucx-info -c` lists them and typos are caught).
pub static CONFIG: &[crate::config::OptionSpec] = &[crate::config::OptionSpec {
    name: "LOG_LEVEL",
    kind: crate::config::OptKind::Str,
    default: "warn",
    help: "Logging level: error, warn, info, debug, trace, or a tracing filter directive.",
}];
