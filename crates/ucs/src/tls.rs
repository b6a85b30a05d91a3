//! Transport selection lists (`RUCX_TLS`), in the spirit of `UCX_TLS`.
//!
//! A list names transports or aliases, comma separated. `all` selects everything. A leading `^`
//! negates the whole list: `^cuda_ipc,tcp` means every transport except cuda_ipc and tcp.

use std::collections::BTreeSet;

/// Transport names rucx knows, whether or not they are available on this host.
pub const TRANSPORTS: &[&str] = &[
    "self",
    "posix",
    "tcp",
    "cuda_copy",
    "cuda_ipc",
    "gdr_copy",
    "rc_verbs",
];

/// Aliases and what they expand to.
pub const ALIASES: &[(&str, &[&str])] = &[
    ("sm", &["posix"]),
    ("shm", &["posix"]),
    ("cuda", &["cuda_copy", "cuda_ipc", "gdr_copy"]),
    ("ib", &["rc_verbs"]),
    ("rc", &["rc_verbs"]),
];

/// The accepted forms, for error messages.
pub fn accepted_forms() -> String {
    let mut words: Vec<&str> = vec!["all"];
    words.extend(ALIASES.iter().map(|(a, _)| *a));
    words.extend(TRANSPORTS.iter().copied());
    format!(
        "a comma-separated list of {}; a leading ^ excludes the listed ones",
        words.join(", ")
    )
}

/// A parsed transport selection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSelection {
    negate: bool,
    /// Expanded transport names (or `all`).
    names: BTreeSet<String>,
    all: bool,
    /// What the user wrote, for messages.
    text: String,
}

impl TlsSelection {
    /// Parse a list; unknown names are an error listing what is accepted.
    pub fn parse(s: &str) -> Result<TlsSelection, String> {
        let text = s.trim().to_string();
        let (negate, body) = match text.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, text.as_str()),
        };
        let mut names = BTreeSet::new();
        let mut all = false;
        for word in body.split(',').map(str::trim) {
            if word.is_empty() {
                continue;
            }
            let w = word.to_ascii_lowercase();
            if w.starts_with('^') {
                return Err(format!(
                    "{word:?}: ^ may only stand once, at the start of the whole list"
                ));
            }
            if w == "all" {
                all = true;
            } else if let Some((_, expand)) = ALIASES.iter().find(|(a, _)| *a == w) {
                names.extend(expand.iter().map(|s| s.to_string()));
            } else if TRANSPORTS.contains(&w.as_str()) {
                names.insert(w);
            } else {
                return Err(format!("unknown transport or alias {word:?}"));
            }
        }
        if !all && names.is_empty() {
            return Err("the list selects no transport".into());
        }
        if negate && all {
            return Err("^all would exclude every transport".into());
        }
        Ok(TlsSelection {
            negate,
            names,
            all,
            text,
        })
    }

    /// Whether transport `tl_name` is selected.
    pub fn allows(&self, tl_name: &str) -> bool {
        let listed = self.all || self.names.contains(tl_name);
        listed != self.negate
    }

    /// True for the default `all` selection.
    pub fn is_all(&self) -> bool {
        self.all && !self.negate
    }

    /// The list as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn aliases_expand() {
        let t = TlsSelection::parse("sm,cuda").unwrap();
        for tl in ["posix", "cuda_copy", "cuda_ipc", "gdr_copy"] {
            assert!(t.allows(tl), "{tl}");
        }
        assert!(!t.allows("tcp"));
        assert!(!t.allows("self"));
    }

    #[test]
    fn negation_excludes() {
        let t = TlsSelection::parse("^cuda_ipc").unwrap();
        assert!(!t.allows("cuda_ipc"));
        assert!(t.allows("tcp") && t.allows("cuda_copy"));
    }

    #[test]
    fn errors_are_clear() {
        let e = TlsSelection::parse("bogus").unwrap_err();
        assert!(e.contains("bogus"));
        assert!(TlsSelection::parse("tcp,^posix").is_err());
        assert!(TlsSelection::parse("").is_err());
        assert!(TlsSelection::parse("^all").is_err());
    }

    proptest! {
        #[test]
        fn any_subset_round_trips(mask in 1u32..(1 << TRANSPORTS.len()), neg in any::<bool>()) {
            let chosen: Vec<&str> = TRANSPORTS.iter().enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0).map(|(_, t)| *t).collect();
            let text = format!("{}{}", if neg { "^" } else { "" }, chosen.join(","));
            let sel = TlsSelection::parse(&text).unwrap();
            for tl in TRANSPORTS {
                prop_assert_eq!(sel.allows(tl), chosen.contains(tl) != neg);
            }
        }

        #[test]
        fn parser_never_panics(s in ".{0,40}") {
            let _ = TlsSelection::parse(&s);
        }

        /// Aliases and names mix freely, in any case and with spaces; the selection is the
        /// union of their expansions.
        #[test]
        fn aliases_and_names_mix(
            picks in prop::collection::vec((0..ALIASES.len() + TRANSPORTS.len(), any::<bool>()), 1..6),
            neg in any::<bool>(),
        ) {
            let mut words = Vec::new();
            let mut want: BTreeSet<&str> = BTreeSet::new();
            for (i, upper) in picks {
                let w = if i < ALIASES.len() {
                    want.extend(ALIASES[i].1.iter().copied());
                    ALIASES[i].0
                } else {
                    want.insert(TRANSPORTS[i - ALIASES.len()]);
                    TRANSPORTS[i - ALIASES.len()]
                };
                words.push(if upper { w.to_ascii_uppercase() } else { w.to_string() });
            }
            let text = format!("{}{}", if neg { "^" } else { "" }, words.join(" , "));
            let sel = TlsSelection::parse(&text).unwrap();
            prop_assert_eq!(sel.as_str(), text.as_str());
            for tl in TRANSPORTS {
                prop_assert_eq!(sel.allows(tl), want.contains(tl) != neg, "{} in {:?}", tl, text);
            }
            prop_assert!(!sel.is_all());
        }
    }
}
