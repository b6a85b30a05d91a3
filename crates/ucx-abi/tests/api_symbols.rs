//! Every function of UCX's public ucp API is exported by rucx's libucp, so that a program
//! linked against UCX loads and finds each symbol it names (a missing one fails at load time,
//! for the whole program, whatever it calls). The API is read from the installed UCX: the
//! names declared in its ucp headers that its own `libucp.so` exports (Debian's `libucx-dev`:
//! `/usr/include/ucp/api`, `/usr/lib/x86_64-linux-gnu/libucp.so`). Without the package the
//! test says so and passes, except under CI (`CI` set), where it fails.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

mod common;
use common::{abi_lib_dir, run_ok};

const HEADERS: &str = "/usr/include/ucp/api";
const UCX_LIB: &str = "/usr/lib/x86_64-linux-gnu/libucp.so";

/// The names `nm -D` lists as defined by the library at `path`.
fn exported(path: &Path) -> BTreeSet<String> {
    run_ok(
        Command::new("nm").args(["-D", "--defined-only"]).arg(path),
        "nm",
    )
    .lines()
    .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
    .collect()
}

/// Every `ucp_name(` in the headers of `dir`.
fn declared(dir: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for e in std::fs::read_dir(dir).expect("the ucp headers") {
        let path = e.expect("a header").path();
        if path.extension().is_none_or(|x| x != "h") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a readable header");
        let b = text.as_bytes();
        let mut i = 0;
        while let Some(at) = text[i..].find("ucp_") {
            let start = i + at;
            let word_start =
                start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
            let mut end = start;
            while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
                end += 1;
            }
            let mut k = end;
            while k < b.len() && b[k].is_ascii_whitespace() {
                k += 1;
            }
            if word_start && k < b.len() && b[k] == b'(' {
                names.insert(text[start..end].to_owned());
            }
            i = end.max(start + 1);
        }
    }
    names
}

#[test]
fn every_public_ucp_function_is_exported() {
    if !Path::new(HEADERS).is_dir() || !Path::new(UCX_LIB).exists() {
        let msg = format!(
            "UCX's headers ({HEADERS}) or library ({UCX_LIB}) are missing: install the Debian \
             package libucx-dev (ci/setup.sh does)"
        );
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let ucx = exported(Path::new(UCX_LIB));
    let api: BTreeSet<_> = declared(Path::new(HEADERS))
        .into_iter()
        .filter(|n| ucx.contains(n))
        .collect();
    assert!(
        api.len() >= 100 && api.contains("ucp_tag_send_nbx") && api.contains("ucp_put"),
        "the API read from the headers looks wrong: {api:?}"
    );
    let (_, lib) = abi_lib_dir("api-symbols");
    let ours = exported(&lib);
    let missing: Vec<_> = api.iter().filter(|n| !ours.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "{} of UCX's {} public ucp functions are not exported by {}: {missing:?}",
        missing.len(),
        api.len(),
        lib.display()
    );
}
