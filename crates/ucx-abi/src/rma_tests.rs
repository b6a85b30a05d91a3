//! The RMA and atomic calls driven as a C caller would: two contexts (as two processes have),
//! a worker each, connected both ways; memory mapped in both forms, keys packed and unpacked,
//! puts and gets in every form with every byte checked, every atomic in every form and width
//! with results checked, flush and fence, and what is refused.

use std::ffi::c_void;

use crate::context::{AbiContext, ucp_cleanup, ucp_init_version};
use crate::endpoint::{AbiEp, ucp_ep_close_nb, ucp_ep_destroy, ucp_ep_flush_nb, ucp_ep_flush_nbx};
use crate::rma::*;
use crate::status::{ptr_is_err, ptr_is_ptr};
use crate::tag::{ucp_request_check_status, ucp_request_free};
use crate::types::*;
use crate::worker::*;

/// A context on the transports `tls` names (`None`: as the environment says).
fn context_on(tls: Option<&std::ffi::CStr>) -> *mut AbiContext {
    let params = UcpParams {
        field_mask: UCP_PARAM_FIELD_FEATURES,
        features: UCP_FEATURE_RMA | UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64,
        request_size: 0,
        request_init: None,
        request_cleanup: None,
        tag_sender_mask: 0,
        mt_workers_shared: 0,
        estimated_num_eps: 0,
        estimated_num_ppn: 0,
        name: std::ptr::null(),
    };
    let mut ctx = std::ptr::null_mut();
    let mut cfg: *mut crate::config::AbiConfig = std::ptr::null_mut();
    // SAFETY: valid params and out pointers; a NULL config reads the environment.
    unsafe {
        if let Some(t) = tls {
            use crate::config::{ucp_config_modify, ucp_config_read};
            assert_eq!(
                ucp_config_read(std::ptr::null(), std::ptr::null(), &mut cfg),
                UCS_OK
            );
            assert_eq!(ucp_config_modify(cfg, c"TLS".as_ptr(), t.as_ptr()), UCS_OK);
        }
        assert_eq!(ucp_init_version(1, 16, &params, cfg, &mut ctx), UCS_OK);
        if !cfg.is_null() {
            crate::config::ucp_config_release(cfg);
        }
    }
    ctx
}

/// Two contexts with a worker each; `ep[i]`: worker i to worker 1 - i.
struct Two {
    ctx: [*mut AbiContext; 2],
    w: [*mut AbiWorker; 2],
    ep: [*mut AbiEp; 2],
}

impl Two {
    fn new() -> Two {
        Two::on(None)
    }

    fn on(tls: Option<&std::ffi::CStr>) -> Two {
        let ctx = [context_on(tls), context_on(tls)];
        let mut w = [std::ptr::null_mut(); 2];
        // SAFETY: every pointer handed in is valid for what the call does with it.
        let ep = unsafe {
            let wp: WorkerParams = std::mem::zeroed();
            for i in 0..2 {
                assert_eq!(ucp_worker_create(ctx[i], &wp, &mut w[i]), UCS_OK);
            }
            crate::test_util::connect_both(w)
        };
        Two { ctx, w, ep }
    }

    fn progress(&self) {
        // SAFETY: live workers.
        unsafe {
            ucp_worker_progress(self.w[0]);
            ucp_worker_progress(self.w[1]);
        }
    }

    /// Wait for what a `_nb`/`_nbx` call returned: its final status (the request freed).
    #[track_caller]
    fn wait(&self, r: *mut c_void) -> Status {
        if r.is_null() {
            return UCS_OK;
        }
        if ptr_is_err(r) {
            return r as isize as Status;
        }
        for _ in 0..1_000_000 {
            // SAFETY: a live request of ours.
            let s = unsafe { ucp_request_check_status(r) };
            if s != UCS_INPROGRESS {
                // SAFETY: freed once.
                unsafe { ucp_request_free(r) };
                return s;
            }
            self.progress();
        }
        panic!("request never completed");
    }

    /// Flush worker 0 while worker 1 progresses (from a helper thread standing in for the
    /// peer process is not possible: workers are single-threaded; the flush progresses worker
    /// 0 only, so worker 1 is progressed first until nothing is left to answer).
    fn flush0(&self) {
        for _ in 0..200 {
            self.progress();
        }
        // SAFETY: live worker.
        let r = unsafe { ucp_worker_flush_nb(self.w[0], 0, None) };
        assert_eq!(self.wait(r), UCS_OK, "the flush");
    }
}

impl Drop for Two {
    fn drop(&mut self) {
        // SAFETY: made in `new`, destroyed once, in UCX's order.
        unsafe {
            for e in self.ep {
                ucp_ep_destroy(e);
            }
            for w in self.w {
                ucp_worker_destroy(w);
            }
            for c in self.ctx {
                ucp_cleanup(c);
            }
        }
    }
}

/// Map `len` bytes on context `ctx`: allocated by the library (`alloc`) or at `addr`.
fn map(ctx: *mut AbiContext, addr: *mut c_void, len: usize, alloc: bool) -> *mut AbiMem {
    let p = MemMapParams {
        field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | UCP_MEM_MAP_PARAM_FIELD_FLAGS
            | UCP_MEM_MAP_PARAM_FIELD_PROT,
        address: addr,
        length: len,
        flags: if alloc { UCP_MEM_MAP_ALLOCATE } else { 0 } | UCP_MEM_MAP_NONBLOCK,
        prot: 0x303,
        memory_type: 0,
        exported_memh_buffer: std::ptr::null(),
    };
    let mut memh = std::ptr::null_mut();
    // SAFETY: valid params; the memory (when given) outlives the map in every test.
    assert_eq!(unsafe { ucp_mem_map(ctx, &p, &mut memh) }, UCS_OK);
    memh
}

/// The mapped address and length (`ucp_mem_query`).
fn query(memh: *mut AbiMem) -> (*mut u8, usize, u32) {
    let mut a = MemAttr {
        field_mask: UCP_MEM_ATTR_FIELD_ADDRESS
            | UCP_MEM_ATTR_FIELD_LENGTH
            | UCP_MEM_ATTR_FIELD_MEM_TYPE,
        address: std::ptr::null_mut(),
        length: 0,
        mem_type: 99,
    };
    // SAFETY: a live handle, a valid attribute struct.
    assert_eq!(unsafe { ucp_mem_query(memh, &mut a) }, UCS_OK);
    (a.address.cast(), a.length, a.mem_type)
}

/// Pack `memh`'s key on `ctx` and unpack it on `ep`.
fn rkey(ctx: *mut AbiContext, memh: *mut AbiMem, ep: *mut AbiEp) -> *mut AbiRkey {
    let mut buf = std::ptr::null_mut();
    let mut size = 0;
    let mut rk = std::ptr::null_mut();
    // SAFETY: live objects; the buffer is released once after the unpack (a copy of it is
    // what a peer would get: unpacked from a copy here).
    unsafe {
        assert_eq!(ucp_rkey_pack(ctx, memh, &mut buf, &mut size), UCS_OK);
        let copy = std::slice::from_raw_parts(buf.cast::<u8>(), size).to_vec();
        ucp_rkey_buffer_release(buf);
        assert_eq!(
            ucp_ep_rkey_unpack(ep, copy.as_ptr().cast(), &mut rk),
            UCS_OK
        );
    }
    rk
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Both forms of `ucp_mem_map`, then every put and get form: every byte lands, the rest of the
/// region is untouched.
#[test]
fn puts_and_gets_in_every_form_move_every_byte() {
    let t = Two::new();
    let mut given = vec![0u8; 64 << 10];
    let mh_given = map(t.ctx[1], given.as_mut_ptr().cast(), given.len(), false);
    let mh_alloc = map(t.ctx[1], std::ptr::null_mut(), 100_000, true);
    let (ga, gl, gt) = query(mh_given);
    assert_eq!((ga, gl, gt), (given.as_mut_ptr(), given.len(), 0));
    let (aa, al, _) = query(mh_alloc);
    assert_eq!(al, 100_000);
    assert_eq!(aa as usize % 4096, 0, "allocated page-aligned");
    // SAFETY: the library's zeroed allocation of `al` bytes, alive until the unmap.
    let alloc = unsafe { std::slice::from_raw_parts_mut(aa, al) };
    assert!(alloc.iter().all(|&b| b == 0));
    for (mh, base, len) in [(mh_given, ga, gl), (mh_alloc, aa, al)] {
        let rk = rkey(t.ctx[1], mh, t.ep[0]);
        let r = base as u64;
        // SAFETY: in-bounds puts and gets of live local buffers, waited for before reuse.
        unsafe {
            let a = pattern(1000, 1);
            assert!(matches!(
                ucp_put_nbi(t.ep[0], a.as_ptr().cast(), a.len(), r + 8, rk),
                UCS_OK | UCS_INPROGRESS
            ));
            let b = pattern(40_000, 2);
            let req = ucp_put_nb(t.ep[0], b.as_ptr().cast(), b.len(), r + 2000, rk, None);
            assert_eq!(t.wait(req), UCS_OK);
            let c = pattern(3000, 3);
            let req = ucp_put_nbx(
                t.ep[0],
                c.as_ptr().cast(),
                c.len(),
                r + 50_000,
                rk,
                std::ptr::null(),
            );
            assert_eq!(t.wait(req), UCS_OK);
            t.flush0();
            let whole = std::slice::from_raw_parts(base, len);
            assert_eq!(&whole[..8], &[0; 8]);
            assert_eq!(&whole[8..1008], &a[..]);
            assert!(whole[1008..2000].iter().all(|&x| x == 0));
            assert_eq!(&whole[2000..42_000], &b[..]);
            assert_eq!(&whole[50_000..53_000], &c[..]);
            assert!(whole[53_000..].iter().all(|&x| x == 0));
            // Gets of each part back.
            let mut ga = vec![0u8; 1000];
            assert!(matches!(
                ucp_get_nbi(t.ep[0], ga.as_mut_ptr().cast(), 1000, r + 8, rk),
                UCS_OK | UCS_INPROGRESS
            ));
            t.flush0();
            assert_eq!(ga, a);
            let mut gb = vec![0u8; 40_000];
            let req = ucp_get_nb(
                t.ep[0],
                gb.as_mut_ptr().cast(),
                gb.len(),
                r + 2000,
                rk,
                None,
            );
            assert_eq!(t.wait(req), UCS_OK);
            assert_eq!(gb, b);
            let mut gc = vec![0u8; 3000];
            let req = ucp_get_nbx(
                t.ep[0],
                gc.as_mut_ptr().cast(),
                3000,
                r + 50_000,
                rk,
                std::ptr::null(),
            );
            assert_eq!(t.wait(req), UCS_OK);
            assert_eq!(gc, c);
            // Out of the region: refused at the post, nothing written.
            let mut past = [7u8; 16];
            let req = ucp_get_nbx(
                t.ep[0],
                past.as_mut_ptr().cast(),
                16,
                r + len as u64 - 8,
                rk,
                std::ptr::null(),
            );
            assert_eq!(t.wait(req), UCS_ERR_OUT_OF_RANGE);
            assert_eq!(past, [7u8; 16]);
            ucp_rkey_destroy(rk);
        }
    }
    // SAFETY: live handles of their context, unmapped once.
    unsafe {
        assert_eq!(ucp_mem_unmap(t.ctx[1], mh_given), UCS_OK);
        assert_eq!(ucp_mem_unmap(t.ctx[1], mh_alloc), UCS_OK);
    }
}

/// Every atomic, in the three forms and both widths: the fetched value is the old one, the
/// word holds the result, the words around it are untouched.
#[test]
fn atomics_in_every_form_and_width_fetch_and_apply() {
    let t = Two::new();
    let mh = map(t.ctx[1], std::ptr::null_mut(), 64, true);
    let (base, _, _) = query(mh);
    let rk = rkey(t.ctx[1], mh, t.ep[0]);
    let word = |off: usize, size: usize| -> u64 {
        // SAFETY: inside the 64 mapped bytes, aligned.
        unsafe {
            if size == 4 {
                base.add(off).cast::<u32>().read_volatile() as u64
            } else {
                base.add(off).cast::<u64>().read_volatile()
            }
        }
    };
    let set = |off: usize, size: usize, v: u64| {
        // SAFETY: as above.
        unsafe {
            if size == 4 {
                base.add(off).cast::<u32>().write_volatile(v as u32)
            } else {
                base.add(off).cast::<u64>().write_volatile(v)
            }
        }
    };
    let ops = [
        (
            UCP_ATOMIC_OP_ADD,
            UCP_ATOMIC_FETCH_OP_FADD,
            Some(UCP_ATOMIC_POST_OP_ADD),
        ),
        (
            UCP_ATOMIC_OP_AND,
            UCP_ATOMIC_FETCH_OP_FAND,
            Some(UCP_ATOMIC_POST_OP_AND),
        ),
        (
            UCP_ATOMIC_OP_OR,
            UCP_ATOMIC_FETCH_OP_FOR,
            Some(UCP_ATOMIC_POST_OP_OR),
        ),
        (
            UCP_ATOMIC_OP_XOR,
            UCP_ATOMIC_FETCH_OP_FXOR,
            Some(UCP_ATOMIC_POST_OP_XOR),
        ),
        (UCP_ATOMIC_OP_SWAP, UCP_ATOMIC_FETCH_OP_SWAP, None),
        (UCP_ATOMIC_OP_CSWAP, UCP_ATOMIC_FETCH_OP_CSWAP, None),
    ];
    let apply = |op: i32, old: u64, x: u64, z: u64, mask: u64| -> u64 {
        (match op {
            UCP_ATOMIC_OP_ADD => old.wrapping_add(x),
            UCP_ATOMIC_OP_AND => old & x,
            UCP_ATOMIC_OP_OR => old | x,
            UCP_ATOMIC_OP_XOR => old ^ x,
            UCP_ATOMIC_OP_SWAP => x,
            _ if old & mask == x & mask => z,
            _ => old,
        }) & mask
    };
    for size in [4usize, 8] {
        let mask = if size == 4 { u32::MAX as u64 } else { u64::MAX };
        let off = 16;
        for (nbx_op, fetch_op, post_op) in ops {
            for (old, x, z) in [
                (0x1234_5678_9abc_def0u64, 0x0f0f_0f0f_f0f0_f0f0u64, 5u64),
                (0x1234_5678_9abc_def0, 0x1234_5678_9abc_def0, 0xfeed),
            ] {
                let r = base as u64 + off as u64;
                // SAFETY: live endpoint and key; the operands and results outlive the waits.
                unsafe {
                    // ucp_atomic_op_nbx with a reply buffer.
                    set(off, size, old);
                    let mut reply = [0u8; 8];
                    reply[..size].copy_from_slice(&z.to_ne_bytes()[..size]);
                    let xb = x.to_ne_bytes();
                    let mut p: RequestParam = std::mem::zeroed();
                    p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_REPLY_BUFFER;
                    p.datatype = ucp_dt_make_contig(size);
                    p.reply_buffer = reply.as_mut_ptr().cast();
                    let req = ucp_atomic_op_nbx(t.ep[0], nbx_op, xb.as_ptr().cast(), 1, r, rk, &p);
                    assert_eq!(t.wait(req), UCS_OK);
                    let mut got = [0u8; 8];
                    got[..size].copy_from_slice(&reply[..size]);
                    assert_eq!(u64::from_ne_bytes(got), old & mask, "nbx {nbx_op} {size}");
                    assert_eq!(
                        word(off, size),
                        apply(nbx_op, old, x, z, mask),
                        "nbx {nbx_op} {size}"
                    );
                    // ucp_atomic_fetch_nb (compare-and-swap: `value` compared, `*result` in).
                    set(off, size, old);
                    let mut res = [0u8; 8];
                    res[..size].copy_from_slice(&z.to_ne_bytes()[..size]);
                    let req = ucp_atomic_fetch_nb(
                        t.ep[0],
                        fetch_op,
                        x,
                        res.as_mut_ptr().cast(),
                        size,
                        r,
                        rk,
                        None,
                    );
                    assert_eq!(t.wait(req), UCS_OK);
                    let mut got = [0u8; 8];
                    got[..size].copy_from_slice(&res[..size]);
                    assert_eq!(
                        u64::from_ne_bytes(got),
                        old & mask,
                        "fetch {fetch_op} {size}"
                    );
                    assert_eq!(
                        word(off, size),
                        apply(nbx_op, old, x, z, mask),
                        "fetch {fetch_op} {size}"
                    );
                    // Posted forms: ucp_atomic_post and ucp_atomic_op_nbx without a reply.
                    if let Some(pop) = post_op {
                        set(off, size, old);
                        let s = ucp_atomic_post(t.ep[0], pop, x, size, r, rk);
                        assert_eq!(s, UCS_OK, "posted");
                        t.flush0();
                        assert_eq!(
                            word(off, size),
                            apply(nbx_op, old, x, z, mask),
                            "post {pop} {size}"
                        );
                        set(off, size, old);
                        p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
                        let req =
                            ucp_atomic_op_nbx(t.ep[0], nbx_op, xb.as_ptr().cast(), 1, r, rk, &p);
                        assert_eq!(t.wait(req), UCS_OK);
                        assert_eq!(
                            word(off, size),
                            apply(nbx_op, old, x, z, mask),
                            "nbx post {nbx_op} {size}"
                        );
                    } else {
                        p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
                        let req =
                            ucp_atomic_op_nbx(t.ep[0], nbx_op, xb.as_ptr().cast(), 1, r, rk, &p);
                        assert_eq!(t.wait(req), UCS_ERR_INVALID_PARAM, "{nbx_op} needs a reply");
                    }
                }
                assert_eq!(word(0, 8), 0);
                assert_eq!(word(8, 8), 0);
                assert_eq!(word(24, 8), 0);
                if size == 4 {
                    assert_eq!(word(20, 4), 0);
                }
            }
        }
    }
    // SAFETY: live objects, released once.
    unsafe {
        ucp_rkey_destroy(rk);
        assert_eq!(ucp_mem_unmap(t.ctx[1], mh), UCS_OK);
    }
}

/// Bad atomics and maps are refused: misaligned words, bad sizes and opcodes, a region
/// unmapped since its key was packed (refused by the target), the map flags not served; a
/// FIXED map lands where asked and never over another mapping.
#[test]
fn bad_atomics_and_maps_are_refused() {
    let t = Two::new();
    let mh = map(t.ctx[1], std::ptr::null_mut(), 64, true);
    let (base, _, _) = query(mh);
    let rk = rkey(t.ctx[1], mh, t.ep[0]);
    let r = base as u64;
    // SAFETY: live objects; every result buffer outlives its wait.
    unsafe {
        assert_eq!(
            ucp_atomic_post(t.ep[0], UCP_ATOMIC_POST_OP_ADD, 1, 8, r + 4, rk),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_atomic_post(t.ep[0], UCP_ATOMIC_POST_OP_ADD, 1, 2, r, rk),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_atomic_post(t.ep[0], 9, 1, 8, r, rk),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(
            ucp_atomic_post(t.ep[0], UCP_ATOMIC_POST_OP_ADD, 1, 8, r + 64, rk),
            UCS_ERR_OUT_OF_RANGE
        );
        let mut res = 0u64;
        let req = ucp_atomic_fetch_nb(
            t.ep[0],
            UCP_ATOMIC_FETCH_OP_FADD,
            1,
            (&raw mut res).cast(),
            8,
            r + 2,
            rk,
            None,
        );
        assert_eq!(t.wait(req), UCS_ERR_INVALID_PARAM);
        let mut p: RequestParam = std::mem::zeroed();
        p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
        p.datatype = ucp_dt_make_contig(2);
        let one = 1u64;
        let req = ucp_atomic_op_nbx(
            t.ep[0],
            UCP_ATOMIC_OP_ADD,
            (&raw const one).cast(),
            1,
            r,
            rk,
            &p,
        );
        assert_eq!(t.wait(req), UCS_ERR_INVALID_PARAM);
        p.datatype = ucp_dt_make_contig(8);
        let req = ucp_atomic_op_nbx(
            t.ep[0],
            UCP_ATOMIC_OP_ADD,
            (&raw const one).cast(),
            2,
            r,
            rk,
            &p,
        );
        assert_eq!(t.wait(req), UCS_ERR_INVALID_PARAM);
        assert!(std::slice::from_raw_parts(base, 64).iter().all(|&b| b == 0));
        // The target refuses a word of a region it unmapped (its key still unpacks here).
        let given = Box::leak(vec![0u64; 4].into_boxed_slice());
        let mh2 = map(t.ctx[1], given.as_mut_ptr().cast(), 32, false);
        let rk2 = rkey(t.ctx[1], mh2, t.ep[0]);
        assert_eq!(ucp_mem_unmap(t.ctx[1], mh2), UCS_OK);
        let mut res = 5u64;
        let req = ucp_atomic_fetch_nb(
            t.ep[0],
            UCP_ATOMIC_FETCH_OP_FADD,
            1,
            (&raw mut res).cast(),
            8,
            given.as_ptr() as u64,
            rk2,
            None,
        );
        assert!(ptr_is_ptr(req) || req.is_null() || ptr_is_err(req));
        assert_eq!(t.wait(req), UCS_ERR_INVALID_PARAM);
        assert_eq!(res, 5);
        assert_eq!(given, &[0, 0, 0, 0]);
        // Its request said so; the next flush says it too, once.
        assert_eq!(
            t.wait(ucp_ep_flush_nb(t.ep[0], 0, None)),
            UCS_ERR_INVALID_PARAM
        );
        ucp_rkey_destroy(rk2);
        // Maps: FIXED places the pages exactly where asked, and never over a mapping; exported
        // handles are not served; no length or unknown bits are invalid.
        let mut out = std::ptr::null_mut();
        let mut mp = MemMapParams {
            field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            address: base.cast(),
            length: 4096,
            flags: UCP_MEM_MAP_ALLOCATE | UCP_MEM_MAP_FIXED,
            prot: 0,
            memory_type: 0,
            exported_memh_buffer: std::ptr::null(),
        };
        assert_eq!(
            ucp_mem_map(t.ctx[1], &mp, &mut out),
            UCS_ERR_NO_MEMORY,
            "over a mapping"
        );
        assert!(out.is_null());
        let spot = map(t.ctx[1], std::ptr::null_mut(), 8192, true);
        let (free_at, _, _) = query(spot);
        assert_eq!(ucp_mem_unmap(t.ctx[1], spot), UCS_OK);
        mp.address = free_at.cast();
        assert_eq!(ucp_mem_map(t.ctx[1], &mp, &mut out), UCS_OK);
        assert_eq!(query(out).0, free_at, "FIXED maps at the address");
        let rk4 = rkey(t.ctx[1], out, t.ep[0]);
        let mut res = 0u64;
        let req = ucp_atomic_fetch_nb(
            t.ep[0],
            UCP_ATOMIC_FETCH_OP_FADD,
            9,
            (&raw mut res).cast(),
            8,
            free_at as u64 + 8,
            rk4,
            None,
        );
        assert_eq!(t.wait(req), UCS_OK);
        assert_eq!(free_at.add(8).cast::<u64>().read(), 9);
        ucp_rkey_destroy(rk4);
        assert_eq!(ucp_mem_unmap(t.ctx[1], out), UCS_OK);
        out = std::ptr::null_mut();
        mp.address = free_at.add(1).cast();
        assert_eq!(
            ucp_mem_map(t.ctx[1], &mp, &mut out),
            UCS_ERR_INVALID_PARAM,
            "unaligned"
        );
        mp.field_mask &= !UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
        mp.flags = UCP_MEM_MAP_ALLOCATE;
        mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER;
        assert_eq!(ucp_mem_map(t.ctx[1], &mp, &mut out), UCS_ERR_UNSUPPORTED);
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_FLAGS;
        assert_eq!(ucp_mem_map(t.ctx[1], &mp, &mut out), UCS_ERR_INVALID_PARAM);
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | (1 << 9);
        assert_eq!(ucp_mem_map(t.ctx[1], &mp, &mut out), UCS_ERR_INVALID_PARAM);
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        assert_eq!(
            ucp_mem_map(t.ctx[1], &mp, &mut out),
            UCS_ERR_INVALID_PARAM,
            "no address"
        );
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | UCP_MEM_MAP_PARAM_FIELD_FLAGS
            | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.memory_type = UCS_MEMORY_TYPE_CUDA;
        assert_eq!(ucp_mem_map(t.ctx[1], &mp, &mut out), UCS_ERR_UNSUPPORTED);
        assert!(out.is_null());
        // A key buffer that is not one.
        let junk = [0u8; 32];
        let mut rk3 = std::ptr::null_mut();
        assert_eq!(
            ucp_ep_rkey_unpack(t.ep[0], junk.as_ptr().cast(), &mut rk3),
            UCS_ERR_INVALID_PARAM
        );
        assert_eq!(ucp_worker_fence(t.w[0]), UCS_OK);
        ucp_rkey_destroy(rk);
        assert_eq!(ucp_mem_unmap(t.ctx[1], mh), UCS_OK);
    }
}

/// The status a flush's callback was called with (its user data), or 1 before.
unsafe extern "C" fn flush_cb(_req: *mut c_void, status: Status, data: *mut c_void) {
    // SAFETY: the test's `Status`, alive until the flush ended.
    unsafe { *data.cast::<Status>() = status };
}

/// Implicit atomics the target refuses after they were posted (a region it unmapped since its
/// key was packed; `ucp_atomic_post` said `UCS_OK`): the flush that follows, in every form,
/// ends with the refusal, a request when the answer is still to come, and reports it once;
/// the fence reports it too. Nothing is written.
#[test]
fn a_flush_ends_with_the_error_of_an_implicit_operation_after_its_post() {
    let t = Two::new();
    let given = Box::leak(vec![0u64; 4].into_boxed_slice());
    let mh = map(t.ctx[1], given.as_mut_ptr().cast(), 32, false);
    let rk = rkey(t.ctx[1], mh, t.ep[0]);
    let at = given.as_ptr() as u64;
    // SAFETY: live objects; the status a callback writes outlives its flush.
    unsafe {
        assert_eq!(ucp_mem_unmap(t.ctx[1], mh), UCS_OK);
        let post = || {
            assert_eq!(
                ucp_atomic_post(t.ep[0], UCP_ATOMIC_POST_OP_ADD, 1, 8, at, rk),
                UCS_OK,
                "posted"
            );
        };
        post();
        let f = ucp_ep_flush_nb(t.ep[0], 0, None);
        assert!(ptr_is_ptr(f), "the answer is to come: a request");
        assert_eq!(t.wait(f), UCS_ERR_INVALID_PARAM);
        assert_eq!(t.wait(ucp_ep_flush_nb(t.ep[0], 0, None)), UCS_OK, "once");
        // The worker's flush, with a callback.
        post();
        let mut seen: Status = 1;
        let mut p: RequestParam = std::mem::zeroed();
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        p.cb.send = Some(flush_cb);
        p.user_data = (&raw mut seen).cast();
        let f = ucp_worker_flush_nbx(t.w[0], &p);
        assert!(ptr_is_ptr(f));
        assert_eq!(t.wait(f), UCS_ERR_INVALID_PARAM);
        assert_eq!(seen, UCS_ERR_INVALID_PARAM, "the callback was told");
        assert_eq!(
            t.wait(ucp_worker_flush_nbx(t.w[0], std::ptr::null())),
            UCS_OK
        );
        // Refused before the flush is posted (the answer in, nobody looked): in place.
        post();
        for _ in 0..200 {
            t.progress();
        }
        let f = ucp_ep_flush_nbx(t.ep[0], std::ptr::null());
        assert_eq!(t.wait(f), UCS_ERR_INVALID_PARAM);
        assert_eq!(t.wait(ucp_ep_flush_nbx(t.ep[0], std::ptr::null())), UCS_OK);
        // The fence is a flush: it reports it (and the next flush does not).
        post();
        for _ in 0..200 {
            t.progress();
        }
        assert_eq!(ucp_worker_fence(t.w[0]), UCS_ERR_INVALID_PARAM);
        assert_eq!(ucp_worker_fence(t.w[0]), UCS_OK);
        assert_eq!(t.wait(ucp_worker_flush_nb(t.w[0], 0, None)), UCS_OK);
        ucp_rkey_destroy(rk);
    }
    assert_eq!(given, &[0, 0, 0, 0], "nothing written");
}

/// Implicit operations to a peer that fails before carrying them out (its worker destroyed
/// while they are in flight; tcp: its connections close): the worker's flush ends with the
/// error (once), the failed endpoint's flush with the endpoint's error; never a silent
/// `UCS_OK`.
#[test]
fn a_flush_ends_with_the_error_of_implicit_operations_a_failed_peer_lost() {
    let mut t = Two::on(Some(c"tcp"));
    let mh = map(t.ctx[1], std::ptr::null_mut(), 4096, true);
    let (base, _, _) = query(mh);
    let rk = rkey(t.ctx[1], mh, t.ep[0]);
    let r = base as u64;
    let mut back = vec![0u8; 1024];
    // SAFETY: live objects until destroyed here (and cleared so that `Drop` skips them); the
    // get's buffer outlives the worker's flush.
    unsafe {
        // Working: one atomic answered.
        assert_eq!(
            ucp_atomic_post(t.ep[0], UCP_ATOMIC_POST_OP_ADD, 5, 8, r, rk),
            UCS_OK
        );
        t.flush0();
        assert_eq!(base.cast::<u64>().read(), 5);
        // Posted; the target never progresses again, and goes.
        assert_eq!(
            ucp_atomic_post(t.ep[0], UCP_ATOMIC_POST_OP_ADD, 1, 8, r, rk),
            UCS_OK
        );
        let g = ucp_get_nbi(t.ep[0], back.as_mut_ptr().cast(), back.len(), r + 8, rk);
        assert!(g == UCS_OK || g == UCS_INPROGRESS, "{g}");
        assert!(ucp_ep_close_nb(t.ep[1], UCP_EP_CLOSE_MODE_FORCE).is_null());
        t.ep[1] = std::ptr::null_mut();
        assert_eq!(ucp_mem_unmap(t.ctx[1], mh), UCS_OK);
        ucp_worker_destroy(t.w[1]);
        t.w[1] = std::ptr::null_mut();
        let f = ucp_worker_flush_nb(t.w[0], 0, None);
        let s = t.wait(f);
        assert!(s < 0, "the worker's flush reports the loss: {s}");
        assert_eq!(t.wait(ucp_worker_flush_nb(t.w[0], 0, None)), UCS_OK, "once");
        let s = t.wait(ucp_ep_flush_nbx(t.ep[0], std::ptr::null()));
        assert!(s < 0, "the failed endpoint's flush: {s}");
        ucp_rkey_destroy(rk);
    }
}

/// `ucp_dt_make_contig(elem_size)`.
fn ucp_dt_make_contig(elem: usize) -> u64 {
    ((elem as u64) << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG
}
