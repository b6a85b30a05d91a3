//! `rucx-bench-compare`: rucx-perftest against ucx_perftest on this machine; see `--help`.

fn main() -> std::process::ExitCode {
    rucx_perftest::compare::main()
}
