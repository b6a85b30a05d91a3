//! The seed program of rucx, ported: ranks exchange buffers, verify every element, report
//! success — then the same across every protocol size class, and the bandwidth.
//!
//! Launch two ranks with `cargo xtask demo`, `mpirun -np 2`, `srun -n 2`, or by hand:
//! `RUCX_RANK=0 RUCX_SIZE=2 RUCX_BOOTSTRAP=127.0.0.1:29500 exchange` and the same with
//! `RUCX_RANK=1` in a second shell.
//!
//! Options: `--count N` (elements of the first exchange, default 1024), `--bw-size BYTES`
//! (default 64M), `--iters K` (default 10).

use std::process::ExitCode;
use std::time::Instant;

use rucx::{Job, TAG_MASK_FULL};

struct Args {
    count: usize,
    bw_size: usize,
    iters: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        count: 1024,
        bw_size: 64 << 20,
        iters: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--count" => a.count = val()?.parse().map_err(|e| format!("--count: {e}"))?,
            "--bw-size" => {
                a.bw_size = match rucx::ucs::units::parse_memunits(&val()?)? {
                    rucx::ucs::MemUnits::Bytes(b) => b as usize,
                    _ => return Err("--bw-size takes a byte count".into()),
                }
            }
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "-h" | "--help" => {
                return Err("usage: exchange [--count N] [--bw-size BYTES] [--iters K]".into());
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

fn element(rank: usize, i: usize) -> i32 {
    ((rank as i32) << 24) | (i as i32 & 0x00ff_ffff)
}

fn as_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn pattern(rank: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(131) ^ (rank * 17)) as u8)
        .collect()
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let job = Job::from_env().map_err(|e| e.to_string())?;
    let (rank, size) = (job.rank(), job.size());
    let w = job.worker();
    let next = (rank + 1) % size;
    let prev = (rank + size - 1) % size;
    let to = job.ep(next);

    if rank == 0 {
        let (am, rma) = w.lanes(to).map_err(|e| e.to_string())?;
        println!(
            "rank 0 of {size} ({}): transports {}; to rank {next}: active messages on {am}, rendezvous on {}",
            job.placement().source,
            w.transports().join(", "),
            rma.as_deref().unwrap_or("(active messages)")
        );
        println!("{}", w.proto_info(to).map_err(|e| e.to_string())?);
    }

    // 1. The seed's exchange: every element verified.
    let mine: Vec<i32> = (0..args.count).map(|i| element(rank, i)).collect();
    let send = as_bytes(&mine);
    let mut recv = vec![0u8; send.len()];
    w.scope(|s| {
        let r = s.tag_recv(&mut recv, prev as u64, TAG_MASK_FULL);
        let sd = s.tag_send(to, &send, rank as u64);
        sd.wait()?;
        r.wait()
    })
    .map_err(|e| format!("rank {rank}: exchange failed: {e}"))?;
    for (i, chunk) in recv.chunks_exact(4).enumerate() {
        let got = i32::from_le_bytes(chunk.try_into().expect("4 bytes"));
        if got != element(prev, i) {
            return Err(format!(
                "rank {rank}: data received wrong at element {i}: {got:#x}, expected {:#x}",
                element(prev, i)
            ));
        }
    }
    println!(
        "rank {rank}: success ({} elements from rank {prev} verified)",
        args.count
    );

    // 2. Every protocol size class, every byte checked.
    for (k, &n) in [0usize, 1, 8191, 8192, 8193, 65536, (1 << 20) + 3, 16 << 20]
        .iter()
        .enumerate()
    {
        let send = pattern(rank, n);
        let mut recv = vec![0u8; n];
        let tag = 1000 + k as u64;
        w.scope(|s| {
            let r = s.tag_recv(&mut recv, tag, TAG_MASK_FULL);
            s.tag_send(to, &send, tag).wait()?;
            r.wait()
        })
        .map_err(|e| format!("rank {rank}: {n} bytes: {e}"))?;
        if recv != pattern(prev, n) {
            return Err(format!("rank {rank}: {n} bytes: data received wrong"));
        }
    }
    if rank == 0 {
        println!("rank 0: sizes 0, 1, 8191, 8192, 8193, 64K, 1M+3, 16M verified");
    }

    // 3. Bandwidth: every rank sends to the next and receives from the previous at once.
    let send = pattern(rank, args.bw_size);
    let mut recv = vec![0u8; args.bw_size];
    job.barrier().map_err(|e| e.to_string())?;
    let t = Instant::now();
    for i in 0..args.iters {
        let tag = 5000 + i as u64;
        w.scope(|s| {
            let r = s.tag_recv(&mut recv, tag, TAG_MASK_FULL);
            s.tag_send(to, &send, tag).wait()?;
            r.wait()
        })
        .map_err(|e| format!("rank {rank}: bandwidth round {i}: {e}"))?;
    }
    let secs = t.elapsed().as_secs_f64();
    if recv != pattern(prev, args.bw_size) {
        return Err(format!("rank {rank}: bandwidth data received wrong"));
    }
    job.barrier().map_err(|e| e.to_string())?;
    let gbs = (args.bw_size * args.iters) as f64 / secs / 1e9;
    println!(
        "rank {rank}: {} x {} MiB sent while receiving as many: {gbs:.2} GB/s per direction",
        args.iters,
        args.bw_size >> 20
    );
    let c = w.counters();
    if rank == 0 {
        let used: Vec<String> = c.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        println!("rank 0: protocols used: {}", used.join(", "));
    }
    for d in job.context().demotions() {
        println!("rank {rank}: demotion: {d} ({})", d.knob);
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("exchange: {e}");
            ExitCode::FAILURE
        }
    }
}
