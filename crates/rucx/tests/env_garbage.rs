//! Every `RUCX_*` option set to garbage, as a user's typo or a script's bug would set it:
//! the configuration refuses what its kind does not accept with `Error::Config` naming the
//! variable and the accepted forms, and for the few free-text options that take any text the
//! context and worker either come up or fail with an error naming the variable. Never a
//! panic; never a value silently taken for another.

use std::panic::{AssertUnwindSafe, catch_unwind};

use rucx::Error;
use rucx::ucs::{Config, OptKind};

const GARBAGE: &[&str] = &[
    "garbage",
    "-1",
    "99999999999999999999999999",
    "",
    "1e9999",
    "0x",
    "\u{7f}\u{1}",
    "yes please",
    "1,2,,",
];

/// Kinds that take any text (their meaning is checked where it is used).
fn free_text(k: &OptKind) -> bool {
    matches!(k, OptKind::Str | OptKind::List)
}

#[test]
fn every_option_refuses_garbage_by_name_or_its_use_says_so() {
    let tables = rucx::config_tables();
    let mut checked = 0;
    let mut free = Vec::new();
    for t in &tables {
        for spec in t.iter() {
            let var = format!("RUCX_{}", spec.name);
            for g in GARBAGE {
                let got = catch_unwind(AssertUnwindSafe(|| {
                    Config::from_vars(&tables, [(var.as_str(), *g)])
                }));
                match got {
                    Err(_) => panic!("{var}={g:?}: the configuration panicked"),
                    Ok(Err(Error::Config {
                        var: v, accepted, ..
                    })) => {
                        assert_eq!(v, var, "{g:?}");
                        assert!(!accepted.is_empty(), "{var}: no accepted forms");
                    }
                    Ok(Err(other)) => panic!("{var}={g:?}: not a Config error: {other:?}"),
                    Ok(Ok(cfg)) => {
                        // Only free text takes "garbage"; other kinds may take some of the
                        // forms ("" for a secret, "-1"...) only where they are valid values.
                        assert!(
                            free_text(&spec.kind) || *g != "garbage",
                            "{var}={g:?} was accepted by a {:?} option",
                            spec.kind
                        );
                        if free_text(&spec.kind) && *g == "garbage" {
                            free.push((var.clone(), cfg));
                        }
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "{checked}");
    // The free-text options with garbage: a context and worker on the loopback transports
    // come up, or the error names the variable.
    for (var, mut cfg) in free {
        if var != "RUCX_TLS" {
            cfg.set("TLS", "self,posix").unwrap();
        }
        let res = catch_unwind(AssertUnwindSafe(|| {
            let ctx = rucx::Context::new(&rucx_transports::registry(), cfg)?;
            rucx::Worker::new(&ctx).map(drop)
        }));
        match res {
            Err(_) => panic!("{var}=garbage: context or worker creation panicked"),
            Ok(Ok(())) => {}
            Ok(Err(e)) => assert!(e.to_string().contains(&var), "{var}=garbage: {e}"),
        }
    }
}
