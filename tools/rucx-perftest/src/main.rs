//! `rucx-perftest`: see the library documentation and `rucx-perftest --help`.

fn main() -> std::process::ExitCode {
    rucx_perftest::cli::main()
}
