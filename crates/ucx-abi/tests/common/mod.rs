//! What the C-program tests share: running a build step, and the library folder the programs
//! load rucx's libucp from.

use std::path::PathBuf;
use std::process::Command;

/// Run `cmd` and return its standard output; a failure panics with both outputs.
pub fn run_ok(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `target/<profile>/NAME`, holding `libucp.so.0` (a link to this crate's cdylib, which cargo
/// builds next to the test executable) and thin `libucs.so.0`, `libuct.so.0`, `libucm.so.0`
/// (the sonames UCX programs also list as needed). Returns the folder and the cdylib's path.
pub fn abi_lib_dir(name: &str) -> (PathBuf, PathBuf) {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir");
    let lib = deps.join("libucp.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    let lib = std::fs::canonicalize(&lib).expect("canonical library path");
    let dir = deps.parent().expect("target dir").join(name);
    std::fs::create_dir_all(&dir).expect("test dir");
    let link = dir.join("libucp.so.0");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).expect("libucp.so.0 link");
    for l in ["ucs", "uct", "ucm"] {
        run_ok(
            Command::new("cc")
                .args(["-shared", "-x", "c", "/dev/null", "-o"])
                .arg(dir.join(format!("lib{l}.so.0")))
                .arg(format!("-Wl,-soname,lib{l}.so.0")),
            "building a thin library",
        );
    }
    (dir, lib)
}
