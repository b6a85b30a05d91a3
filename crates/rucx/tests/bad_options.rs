//! Bad option values are refused where they are read, with the variable named: none of them
//! may silently make a transport unavailable, fail much later, or abort the process.
//!
//! In process through `Config::from_vars` over every table of the job, and end to end through
//! `Job::from_env` in a child process (this test binary again, told apart by `ROLE`).

use std::process::Command;

use rucx::ucs::Config;

const ROLE: &str = "RUCX_TEST_BAD_OPTION_ROLE";

/// The error for one variable set to `value`, with every option table of a job.
fn refused(var: &str, value: &str) -> String {
    match Config::from_vars(&rucx::config_tables(), [(var, value)]) {
        Ok(_) => panic!("{var}={value} was accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_names(msg: &str, var: &str, range: &str) {
    assert!(msg.contains(var), "the message does not name {var}: {msg}");
    assert!(
        msg.contains(range),
        "the message does not give the accepted range {range:?}: {msg}"
    );
}

#[test]
fn rndv_frag_size_zero_is_refused() {
    let m = refused("RUCX_RNDV_FRAG_SIZE", "0");
    assert_names(&m, "RUCX_RNDV_FRAG_SIZE", "from 4K to 1G");
}

#[test]
fn posix_fifo_size_3_is_refused() {
    let m = refused("RUCX_POSIX_FIFO_SIZE", "3");
    assert_names(&m, "RUCX_POSIX_FIFO_SIZE", "a power of two from 2 to 65536");
}

#[test]
fn posix_cell_size_100_is_refused() {
    let m = refused("RUCX_POSIX_CELL_SIZE", "100");
    assert_names(
        &m,
        "RUCX_POSIX_CELL_SIZE",
        "a multiple of 64 from 128 to 1M",
    );
}

#[test]
fn tcp_port_range_garbage_is_refused() {
    let m = refused("RUCX_TCP_PORT_RANGE", "garbage");
    assert_names(&m, "RUCX_TCP_PORT_RANGE", "FIRST-LAST");
}

#[test]
fn a_huge_job_size_is_refused() {
    let m = refused("RUCX_SIZE", "4000000000");
    assert_names(&m, "RUCX_SIZE", "1 to 1048576");
}

#[test]
fn other_zero_or_tiny_values_are_refused() {
    for (var, value, range) in [
        ("RUCX_RNDV_FRAG_COUNT", "0", "from 1 to 1024"),
        ("RUCX_TCP_TX_QUEUE", "0", "at least 64K"),
        ("RUCX_TCP_KEEPCNT", "0", "from 1 to 127"),
        ("RUCX_TCP_KEEPIDLE", "0s", "from 1s to 65535s"),
        ("RUCX_TCP_CONNECT_TIMEOUT", "0s", "from 1ms"),
        ("RUCX_RCACHE_ALIGNMENT", "3000", "a power of two"),
        ("RUCX_BOOTSTRAP_TIMEOUT", "0s", "at least 1ms"),
        ("RUCX_RANK", "x", "a rank from 0"),
        ("RUCX_BOOTSTRAP_KEY", "short", "at least 16 characters"),
    ] {
        let m = refused(var, value);
        assert_names(&m, var, range);
    }
}

/// In a child: start a job from the environment and report how it went.
#[test]
fn child_job_from_env() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    match rucx::Job::from_env() {
        Ok(_) => println!("JOB STARTED"),
        Err(e) => {
            println!("JOB REFUSED: {e}");
            std::process::exit(3);
        }
    }
}

#[test]
fn a_job_with_a_bad_option_is_refused_up_front() {
    let exe = std::env::current_exe().unwrap();
    for (var, value) in [
        ("RUCX_SIZE", "4000000000"),
        ("RUCX_POSIX_FIFO_SIZE", "3"),
        ("RUCX_POSIX_CELL_SIZE", "100"),
        ("RUCX_TCP_PORT_RANGE", "garbage"),
        ("RUCX_RNDV_FRAG_SIZE", "0"),
    ] {
        let start = std::time::Instant::now();
        let o = Command::new(&exe)
            .args(["child_job_from_env", "--exact", "--nocapture"])
            .env(ROLE, "1")
            .env("RUCX_RANK", "0")
            .env("RUCX_SIZE", "2")
            .env("RUCX_BOOTSTRAP", "127.0.0.1:1")
            .env(var, value)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        // A clean error exit (not an abort by signal), before any rank is waited for.
        assert_eq!(o.status.code(), Some(3), "{var}={value}: {text}");
        assert!(
            text.contains("JOB REFUSED") && text.contains(var),
            "{var}={value}: {text}"
        );
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "{var}={value}: took {:?}",
            start.elapsed()
        );
    }
}

/// A transport left out by an option the user set (not by the host) says so once, naming it.
#[test]
fn a_transport_made_unavailable_by_an_option_is_one_warning_naming_it() {
    let exe = std::env::current_exe().unwrap();
    let o = Command::new(&exe)
        .args(["child_job_from_env", "--exact", "--nocapture"])
        .env(ROLE, "1")
        .env("RUCX_RANK", "0")
        .env("RUCX_SIZE", "1")
        .env("RUCX_TCP_IFACES", "nosuch0")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(text.contains("JOB STARTED"), "{text}");
    let warning = "tcp is unavailable because of RUCX_TCP_IFACES=nosuch0";
    assert_eq!(text.matches(warning).count(), 1, "{text}");
}
