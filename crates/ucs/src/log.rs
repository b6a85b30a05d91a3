//! Logging through `tracing`, with the level from `RUCX_LOG_LEVEL`.

use std::sync::Once;

static INIT: Once = Once::new();

/// Install a stderr subscriber once per process, at the level named by `RUCX_LOG_LEVEL`
/// (`error`, `warn` (default), `info`, `debug`, `trace`, `off`, or `tracing` filter directives
/// `target=level`, comma-separated). Does nothing if the application already installed a
/// subscriber. A value [`check_filter`] refuses is refused by the configuration (an
/// [`Error::Config`](crate::Error::Config) naming the variable, from `Config::from_env`); if
/// the subscriber is installed before that, it logs at `warn` and says so.
pub fn init() {
    INIT.call_once(|| {
        let raw = std::env::var("RUCX_LOG_LEVEL").ok();
        let bad = raw.as_deref().and_then(|v| check_filter(v).err());
        let level = match (&raw, &bad) {
            (Some(v), None) => v.as_str(),
            _ => "warn",
        };
        let filter = tracing_subscriber::EnvFilter::try_new(level)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init();
        if let (Some(v), Some(why)) = (raw, bad) {
            tracing::warn!(
                "RUCX_LOG_LEVEL={v:?} is refused ({why}; accepted: {FILTER_FORMS}); logging at warn"
            );
        }
    });
}

/// The forms `RUCX_LOG_LEVEL` accepts, in words.
pub const FILTER_FORMS: &str = "error, warn, info, debug, trace, off, or comma-separated \
                                tracing directives target=level (e.g. rucx_ucp=debug,warn)";

const LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// Why `v` is not a log filter: every comma-separated directive must be a level word or
/// `target=level` (a bare word that is not a level, which `tracing` would take for a target
/// and so silence everything else, is refused: it is most likely a misspelt level).
pub fn check_filter(v: &str) -> std::result::Result<(), String> {
    let is_level = |w: &str| LEVELS.iter().any(|l| l.eq_ignore_ascii_case(w.trim()));
    if v.trim().is_empty() {
        return Err("empty".into());
    }
    for d in v.split(',') {
        let level = match d.rsplit_once('=') {
            Some((target, level)) if !target.trim().is_empty() => level,
            Some(_) => return Err(format!("directive {d:?} has no target before '='")),
            None => d,
        };
        if !is_level(level) {
            return Err(format!("{:?} is not a level", level.trim()));
        }
    }
    tracing_subscriber::EnvFilter::try_new(v)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Options of the services layer (read directly by [`init`], declared here so that
/// `rucx-info -c` lists them and typos are caught).
pub static CONFIG: &[crate::config::OptionSpec] = &[crate::config::OptionSpec {
    name: "LOG_LEVEL",
    kind: crate::config::OptKind::Text(crate::config::Syntax {
        check: check_filter,
        accepted: FILTER_FORMS,
    }),
    default: "warn",
    help: "Logging level: error, warn, info, debug, trace, off, or tracing directives \
           target=level, comma-separated.",
}];

#[cfg(test)]
mod tests {
    use super::*;

    /// Before, any text was taken: `RUCX_LOG_LEVEL=wran` (a bare word) made `tracing` log
    /// only a target named "wran", silencing every warning; unparsable text fell back to
    /// `warn` without a word. Both are refused by the configuration now, naming the variable.
    #[test]
    fn log_levels_and_directives_are_checked() {
        for ok in [
            "warn",
            "DEBUG",
            "off",
            "rucx_ucp=debug,warn",
            "rucx_uct_tcp=trace",
        ] {
            assert_eq!(check_filter(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "wran",
            "3",
            "rucx_ucp=loud",
            "=debug",
            "warn,,",
            "debug=",
            " ",
        ] {
            assert!(check_filter(bad).is_err(), "{bad:?}");
        }
        let e =
            crate::config::Config::from_vars(&[CONFIG], [("RUCX_LOG_LEVEL", "wran")]).unwrap_err();
        match &e {
            crate::Error::Config { var, accepted, .. } => {
                assert_eq!(var, "RUCX_LOG_LEVEL");
                assert!(accepted.contains("debug"), "{accepted}");
            }
            other => panic!("{other:?}"),
        }
    }
}
