//! `cargo xtask <task>`: project chores in Rust, so they run the same everywhere.
//!
//! - `info [rucx-info args]`: build and run `rucx-info` (e.g. `cargo xtask info -d`).
//! - `demo [args]`: build and run the end-to-end two-process example.
//! - `gpu-pack`: build the release test binaries and tools and copy them into `.device/` for
//!   the GPU machine: test executables as `<package>-<test>` (`rucx-uct-cuda-ipc-gpu`) or
//!   `<package>-lib` (a library's unit tests), binaries and examples under their own names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut c: Command) -> Result<(), String> {
    let st = c.status().map_err(|e| format!("running {c:?}: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("{c:?} failed: {st}"))
    }
}

fn info(args: &[String]) -> Result<(), String> {
    let mut c = cargo();
    c.args(["run", "--quiet", "--release", "-p", "rucx-info", "--"])
        .args(args);
    run(c)
}

/// Build the exchange example and run it as two local processes (ranks 0 and 1) that meet on a
/// free loopback port.
fn demo(args: &[String]) -> Result<(), String> {
    // The build needs a few system packages (cmake and libclang for the verbs binding).
    let mut setup = Command::new("bash");
    setup.arg(root().join("ci/setup.sh"));
    run(setup)?;
    let mut c = cargo();
    c.args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "rucx",
        "--example",
        "exchange",
    ]);
    run(c)?;
    let exe = root().join("target/release/examples/exchange");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("finding a free port: {e}"))?
        .port();
    let boot = format!("127.0.0.1:{port}");
    // A fresh job key for the two ranks, passed through their environment (not on a command
    // line, which every user can read); see docs/security.md.
    let key = match std::env::var("RUCX_BOOTSTRAP_KEY") {
        Ok(k) if !k.is_empty() => k,
        _ => {
            let mut b = [0u8; 32];
            getrandom::fill(&mut b).map_err(|e| format!("no random numbers for a key: {e}"))?;
            b.iter().map(|x| format!("{x:02x}")).collect()
        }
    };
    println!(
        "xtask demo: two processes, RUCX_BOOTSTRAP={boot} with a job key, {}",
        exe.display()
    );
    let mut children = Vec::new();
    for rank in 0..2 {
        let child = Command::new(&exe)
            .args(args)
            .env("RUCX_RANK", rank.to_string())
            .env("RUCX_SIZE", "2")
            .env("RUCX_BOOTSTRAP", &boot)
            .env("RUCX_BOOTSTRAP_KEY", &key)
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))?;
        children.push(child);
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        let st = c
            .wait()
            .map_err(|e| format!("waiting for rank {rank}: {e}"))?;
        if !st.success() {
            failed.push(format!("rank {rank}: {st}"));
        }
    }
    if failed.is_empty() {
        println!("xtask demo: both ranks succeeded");
        Ok(())
    } else {
        Err(format!("demo failed: {}", failed.join(", ")))
    }
}

/// rucx-perftest against ucx_perftest (installed from Debian's ucx-utils when missing), shm and
/// tcp, latency and bandwidth, alternated in one sitting; prints each ratio next to the goals.
fn bench_compare(args: &[String]) -> Result<(), String> {
    let mut setup = Command::new("bash");
    setup.arg(root().join("ci/setup.sh"));
    run(setup)?;
    let mut c = cargo();
    c.args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "rucx-perftest",
        "--bin",
        "rucx-bench-compare",
        "--",
    ])
    .args(args);
    run(c)
}

/// An executable that cargo built, as its JSON messages (`--message-format=json`) report it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Artifact {
    /// The package's name, e.g. `rucx-uct-cuda-ipc`.
    package: String,
    /// The target's name, e.g. `gpu` (a test), `rucx-info` (a binary), `rucx_ucs` (a library).
    target: String,
    /// The target's kinds, e.g. `["test"]`, `["bin"]`, `["lib"]`, `["example"]`.
    kinds: Vec<String>,
    /// Built as a test harness (unit or integration tests), not as the program itself.
    test: bool,
    /// Where cargo put it.
    executable: PathBuf,
}

/// The package name in a package id as cargo's JSON messages give it: the id spec form
/// `path+file:///w/crates/ucs#rucx-ucs@0.1.0`, where the name is left out when it is the last
/// segment of the path (`path+file:///w/xtask#0.1.0`), or the older
/// `rucx-ucs 0.1.0 (path+file:///w/crates/ucs)`.
fn package_name(id: &str) -> Option<&str> {
    // The spec form is a URL: no spaces (they are escaped). The older form names the package
    // first, then a space.
    let name = if let Some((name, _)) = id.split_once(' ') {
        name
    } else {
        let (url, fragment) = id.rsplit_once('#')?;
        match fragment.split_once('@') {
            Some((name, _version)) => name,
            None => {
                let path = url.split('?').next().unwrap_or(url);
                path.trim_end_matches('/').rsplit('/').next()?
            }
        }
    };
    (!name.is_empty()).then_some(name)
}

/// The executable one line of cargo's JSON output reports, if it reports one (a
/// `compiler-artifact` message with a non-null `executable`); an error for a line that is not
/// JSON or lacks the fields such a message always has.
fn parse_artifact(line: &str) -> Result<Option<Artifact>, String> {
    let v: serde_json::Value = serde_json::from_str(line)
        .map_err(|e| format!("cargo printed a line that is not JSON ({e}): {line}"))?;
    if v["reason"] != "compiler-artifact" {
        return Ok(None);
    }
    let Some(executable) = v["executable"].as_str() else {
        return Ok(None);
    };
    let field = |what: &str| format!("compiler-artifact message without {what}: {line}");
    let id = v["package_id"]
        .as_str()
        .ok_or_else(|| field("package_id"))?;
    let package = package_name(id).ok_or_else(|| field("a package name in package_id"))?;
    let target = v["target"]["name"]
        .as_str()
        .ok_or_else(|| field("target.name"))?;
    let kinds = v["target"]["kind"]
        .as_array()
        .ok_or_else(|| field("target.kind"))?
        .iter()
        .map(|k| {
            k.as_str()
                .map(str::to_owned)
                .ok_or_else(|| field("target.kind"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let test = v["profile"]["test"]
        .as_bool()
        .ok_or_else(|| field("profile.test"))?;
    Ok(Some(Artifact {
        package: package.to_owned(),
        target: target.to_owned(),
        kinds,
        test,
        executable: PathBuf::from(executable),
    }))
}

/// The file name an executable gets in `.device/`. A binary or an example keeps its own name
/// (`rucx-info`, `gpu_exchange`). A test executable is named after its package and its target,
/// since target names repeat across packages (three have a test named `gpu`):
/// `rucx-uct-cuda-ipc-gpu`, `rucx-ucp-loopback`; a library's own unit tests are
/// `<package>-lib` (`rucx-ucs-lib`), a binary's `<package>-<binary>`.
fn device_name(a: &Artifact) -> String {
    if !a.test {
        return a.target.clone();
    }
    let lib = a.kinds.iter().any(|k| {
        matches!(
            k.as_str(),
            "lib" | "rlib" | "dylib" | "cdylib" | "staticlib" | "proc-macro"
        )
    });
    let what = if lib { "lib" } else { a.target.as_str() };
    format!("{}-{what}", a.package)
}

/// Map each executable to its name in `.device/`; an error when two different executables
/// would get one name (one would overwrite the other).
fn device_names(
    artifacts: impl IntoIterator<Item = Artifact>,
) -> Result<BTreeMap<String, Artifact>, String> {
    let mut names: BTreeMap<String, Artifact> = BTreeMap::new();
    for a in artifacts {
        let name = device_name(&a);
        match names.get(&name) {
            Some(had) if had.executable == a.executable => {}
            Some(had) => {
                return Err(format!(
                    "two executables would be .device/{name}: {} ({} {}) and {} ({} {})",
                    had.executable.display(),
                    had.package,
                    had.target,
                    a.executable.display(),
                    a.package,
                    a.target
                ));
            }
            None => {
                names.insert(name, a);
            }
        }
    }
    Ok(names)
}

/// Build release test executables and tools, strip them, copy them into `.device/` under names
/// that cannot clash ([`device_name`]), and print which is which.
fn gpu_pack(packages: &[String]) -> Result<(), String> {
    let dest = root().join(".device");
    std::fs::create_dir_all(&dest).map_err(|e| format!("creating {}: {e}", dest.display()))?;
    let mut c = cargo();
    c.args(["test", "--release", "--no-run", "--message-format=json"]);
    if packages.is_empty() {
        c.arg("--workspace");
    }
    for p in packages {
        c.args(["-p", p]);
    }
    let out = c
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building test executables failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut artifacts = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(a) = parse_artifact(line)? {
            artifacts.push(a);
        }
    }
    let mut c = cargo();
    c.args(["build", "--release", "-p", "rucx-info"]);
    run(c)?;
    artifacts.push(Artifact {
        package: "rucx-info".into(),
        target: "rucx-info".into(),
        kinds: vec!["bin".into()],
        test: false,
        executable: root().join("target/release/rucx-info"),
    });
    let names = device_names(artifacts)?;
    println!(
        "xtask gpu-pack: {} executables into {}",
        names.len(),
        dest.display()
    );
    for (name, a) in &names {
        let target = dest.join(name);
        std::fs::copy(&a.executable, &target)
            .map_err(|e| format!("copying {}: {e}", a.executable.display()))?;
        let _ = Command::new("strip").arg(&target).status();
        let unit = if a.test && !a.kinds.iter().any(|k| k == "test") {
            " (its unit tests)"
        } else {
            ""
        };
        println!(
            "  {name:<36} <- {} {} {}{unit}: {}",
            a.package,
            a.kinds.join(","),
            a.target,
            a.executable.display()
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        eprintln!("usage: cargo xtask <info|demo|gpu-pack|bench-compare> [args]");
        return ExitCode::from(2);
    };
    let res = match task.as_str() {
        "info" => info(rest),
        "demo" => demo(rest),
        "gpu-pack" => gpu_pack(rest),
        "bench-compare" => bench_compare(rest),
        other => Err(format!(
            "unknown task {other:?}; known: info, demo, gpu-pack, bench-compare"
        )),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(package: &str, target: &str, kind: &str, test: bool) -> Artifact {
        Artifact {
            package: package.into(),
            target: target.into(),
            kinds: vec![kind.into()],
            test,
            executable: PathBuf::from(format!("/w/target/release/deps/{target}-0123abcd")),
        }
    }

    #[test]
    fn tests_of_one_name_in_two_packages_get_two_names() {
        let a = artifact("rucx-uct-cuda-copy", "gpu", "test", true);
        let b = artifact("rucx-uct-cuda-ipc", "gpu", "test", true);
        assert_eq!(device_name(&a), "rucx-uct-cuda-copy-gpu");
        assert_eq!(device_name(&b), "rucx-uct-cuda-ipc-gpu");
        let names = device_names([a, b, artifact("rucx-cuda", "gpu", "test", true)]).unwrap();
        assert_eq!(
            names.keys().collect::<Vec<_>>(),
            [
                "rucx-cuda-gpu",
                "rucx-uct-cuda-copy-gpu",
                "rucx-uct-cuda-ipc-gpu"
            ]
        );
    }

    #[test]
    fn binaries_and_examples_keep_their_names_unit_tests_do_not() {
        let mut bin = artifact("rucx-info", "rucx-info", "bin", false);
        bin.executable = PathBuf::from("/w/target/release/rucx-info");
        assert_eq!(device_name(&bin), "rucx-info");
        let ex = artifact("rucx", "gpu_exchange", "example", false);
        assert_eq!(device_name(&ex), "gpu_exchange");
        // The binary's unit tests and the library's are not mistaken for the binary.
        let bin_tests = artifact("rucx-info", "rucx-info", "bin", true);
        assert_eq!(device_name(&bin_tests), "rucx-info-rucx-info");
        let lib_tests = artifact("rucx-info", "rucx_info", "lib", true);
        assert_eq!(device_name(&lib_tests), "rucx-info-lib");
        let names = device_names([bin.clone(), bin_tests, lib_tests, bin.clone()]).unwrap();
        assert_eq!(names.len(), 3, "the same executable twice is one entry");
    }

    #[test]
    fn a_clash_is_an_error_not_an_overwrite() {
        let a = artifact("a-b", "c", "test", true);
        let b = artifact("a", "b-c", "test", true);
        let e = device_names([a, b]).unwrap_err();
        assert!(e.contains(".device/a-b-c"), "{e}");
    }

    #[test]
    fn package_names_from_ids() {
        assert_eq!(
            package_name("path+file:///w/crates/uct-cuda-ipc#rucx-uct-cuda-ipc@0.1.0"),
            Some("rucx-uct-cuda-ipc")
        );
        assert_eq!(package_name("path+file:///w/xtask#0.1.0"), Some("xtask"));
        assert_eq!(
            package_name("registry+https://github.com/rust-lang/crates.io-index#serde@1.0.0"),
            Some("serde")
        );
        assert_eq!(
            package_name("rucx-ucs 0.1.0 (path+file:///w/crates/ucs)"),
            Some("rucx-ucs")
        );
        assert_eq!(
            package_name("dep 0.2.0 (git+https://example.invalid/x/y?rev=1#0123abcd)"),
            Some("dep")
        );
        assert_eq!(package_name(""), None);
    }

    #[test]
    fn artifacts_from_cargo_json() {
        let test = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/uct-cuda-ipc#rucx-uct-cuda-ipc@0.1.0","manifest_path":"/w/crates/uct-cuda-ipc/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"gpu","src_path":"/w/crates/uct-cuda-ipc/tests/gpu.rs","edition":"2024","doc":false,"doctest":false,"test":true},"profile":{"opt_level":"3","debuginfo":1,"debug_assertions":false,"overflow_checks":false,"test":true},"features":[],"filenames":["/w/target/release/deps/gpu-5f3c2b1a"],"executable":"/w/target/release/deps/gpu-5f3c2b1a","fresh":true}"#;
        let a = parse_artifact(test).unwrap().unwrap();
        assert_eq!(
            a,
            Artifact {
                package: "rucx-uct-cuda-ipc".into(),
                target: "gpu".into(),
                kinds: vec!["test".into()],
                test: true,
                executable: "/w/target/release/deps/gpu-5f3c2b1a".into(),
            }
        );
        assert_eq!(device_name(&a), "rucx-uct-cuda-ipc-gpu");
        // A library (no executable) and other messages are skipped.
        let lib = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/ucs#rucx-ucs@0.1.0","target":{"kind":["lib"],"name":"rucx_ucs"},"profile":{"test":false},"filenames":["/w/target/release/deps/librucx_ucs-1.rlib"],"executable":null,"fresh":true}"#;
        assert_eq!(parse_artifact(lib).unwrap(), None);
        assert_eq!(
            parse_artifact(r#"{"reason":"build-finished","success":true}"#).unwrap(),
            None
        );
        assert!(parse_artifact("warning: not json").is_err());
        let broken = r#"{"reason":"compiler-artifact","executable":"/w/x"}"#;
        assert!(parse_artifact(broken).unwrap_err().contains("package_id"));
    }
}
