//! `rucx-info`: what rucx can use on this host, and why not.

use std::process::ExitCode;

use clap::Parser;
use rucx_ucs::Config;

/// Print rucx resources, configuration and version.
#[derive(Parser, Debug)]
#[command(name = "rucx-info", about, disable_version_flag = true)]
struct Args {
    /// Memory domains and transports, then unavailable components with the reason.
    #[arg(short = 'd')]
    devices: bool,
    /// Every configuration option with its current value and help.
    #[arg(short = 'c')]
    config: bool,
    /// The per-GPU GPU-direct report: what works, and why not.
    #[arg(long = "gpu")]
    gpu: bool,
    /// Protocol selection tables of endpoints created with the current configuration.
    #[arg(short = 'e')]
    endpoints: bool,
    /// Version and built-in components.
    #[arg(short = 'v', long = "version")]
    show_version: bool,
}

fn main() -> ExitCode {
    rucx_ucs::log::init();
    let args = Args::parse();
    let mut tables = rucx_transports::config_tables();
    tables.push(rucx_ucp::CONFIG);
    let cfg = match Config::from_env(&tables) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rucx-info: {e}");
            return ExitCode::from(2);
        }
    };
    let discovery = match rucx_transports::registry().discover(&cfg, Some("TLS")) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("rucx-info: {e}");
            return ExitCode::from(2);
        }
    };
    let none = !(args.devices || args.config || args.show_version || args.gpu || args.endpoints);
    if args.show_version || none {
        print!("{}", rucx_info::render_version(&discovery));
    }
    if args.devices || none {
        print!("{}", rucx_info::render_devices(&discovery, &cfg));
    }
    if args.config {
        print!("{}", rucx_info::render_config(&cfg));
    }
    if args.gpu {
        print!("{}", rucx_cuda::report().render());
    }
    if args.endpoints {
        match rucx_info::render_endpoints(cfg.clone()) {
            Ok(s) => print!("{s}"),
            Err(e) => {
                eprintln!("rucx-info -e: {e}");
                return ExitCode::from(2);
            }
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn arguments_are_consistent() {
        Args::command().debug_assert();
        let a = Args::try_parse_from(["rucx-info", "-d", "-c"]).unwrap();
        assert!(a.devices && a.config && !a.show_version);
        assert!(Args::try_parse_from(["rucx-info", "-q"]).is_err());
    }
}
