//! The shared library answers to the soname Open MPI's components were linked against.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libucp.so.0");
    println!("cargo:rerun-if-changed=build.rs");
}
