//! The first GPU program to copy: two ranks, one device buffer each way, every byte checked,
//! no `unsafe`.
//!
//! GPU buffers implement [`rucx::Memory`], so they are handed to a send as `&buf` and to a
//! receive as `&mut buf`, borrow-checked like slices; `buf.slice(a..b)` sends a part. Host
//! writes (`copy_from_host`, `fill`) are complete when they return, so a buffer can be sent
//! right after.
//!
//! Each rank uses GPU `rank % device_count`. Launch two ranks like `exchange`: `mpirun -np 2`,
//! `srun -n 2`, or two shells with `RUCX_RANK=0|1 RUCX_SIZE=2 RUCX_BOOTSTRAP=127.0.0.1:29500`.

#![forbid(unsafe_code)]

use rucx::cuda::DeviceBuffer;
use rucx::{Job, Memory, TAG_MASK_FULL};

const LEN: usize = 4 << 20;

/// What `rank` sends: no two ranks, and no two nearby bytes, alike.
fn pattern(rank: usize) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i % 251) as u8 ^ (rank as u8).wrapping_mul(0x5b))
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let job = Job::from_env()?;
    let (rank, size) = (job.rank(), job.size());
    let to = job.ep((rank + 1) % size);
    let from = (rank + size - 1) % size;

    let cuda = rucx::cuda::driver()?;
    let gpu = cuda.context(rank as u32 % cuda.device_count())?;
    let mut send = DeviceBuffer::new(gpu, LEN)?;
    let mut recv = DeviceBuffer::new(gpu, LEN)?;
    send.copy_from_host(0, &pattern(rank))?;
    recv.fill(0)?;

    // The whole buffer one way, the whole buffer the other way.
    job.worker().scope(|s| {
        let r = s.tag_recv(&mut recv, 1, TAG_MASK_FULL);
        s.tag_send(to, &send, 1).wait()?;
        r.wait()
    })?;
    let mut got = vec![0u8; LEN];
    recv.copy_to_host(0, &mut got)?;
    if let Some(i) = got.iter().zip(pattern(from)).position(|(a, b)| *a != b) {
        return Err(format!("rank {rank}: byte {i} from rank {from} is wrong").into());
    }

    // A part of a buffer: the second half of `send` into the first half of `recv`.
    job.worker().scope(|s| {
        let r = s.tag_recv(recv.slice_mut(..LEN / 2), 2, TAG_MASK_FULL);
        s.tag_send(to, send.slice(LEN / 2..), 2).wait()?;
        r.wait()
    })?;
    recv.copy_to_host(0, &mut got[..LEN / 2])?;
    if got[..LEN / 2] != pattern(from)[LEN / 2..] {
        return Err(format!("rank {rank}: the half from rank {from} is wrong").into());
    }

    println!(
        "rank {rank}: {} MiB on GPU {} from rank {from} verified, and half of it again",
        LEN >> 20,
        gpu.ordinal()
    );
    Ok(())
}
