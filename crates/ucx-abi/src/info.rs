//! `ucp_worker_print_info`: what UCX's tools and examples print about a worker, in rucx's
//! terms (its name, address length, the transports it opened).

use std::ffi::c_void;

use crate::config::write_stream;
use crate::worker::AbiWorker;

/// The text `ucp_worker_print_info` writes, as UCX's `#`-prefixed lines.
fn worker_info(w: &AbiWorker) -> String {
    let mut s = format!(
        "#\n# ucp_worker rucx:{} (rucx's libucp)\n#\n# address: {} bytes\n#\n",
        std::process::id(),
        w.worker.address().len() + 8
    );
    for t in w.worker.transports() {
        s.push_str(&format!("#   transport: {t}\n"));
    }
    s.push_str("#\n");
    s
}

/// `void ucp_worker_print_info(ucp_worker_h worker, FILE *stream)`.
///
/// # Safety
/// `worker` NULL or live; `stream` NULL or an open `FILE *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_worker_print_info(worker: *const AbiWorker, stream: *mut c_void) {
    // SAFETY: the caller's promise.
    if let Some(w) = unsafe { worker.as_ref() } {
        // SAFETY: the caller's promise on the stream.
        unsafe { write_stream(stream, &worker_info(w)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_info_names_the_workers_transports_and_null_is_ignored() {
        let ctx = crate::cs_tests::context(c"posix");
        let w = crate::cs_tests::worker(ctx);
        // SAFETY: a live worker; NULL arguments are ignored.
        unsafe {
            let text = worker_info(&*w);
            assert!(text.contains("# ucp_worker rucx:"), "{text}");
            assert!(text.contains("transport: posix/"), "{text}");
            ucp_worker_print_info(w, std::ptr::null_mut());
            ucp_worker_print_info(std::ptr::null(), std::ptr::null_mut());
            crate::worker::ucp_worker_destroy(w);
            crate::context::ucp_cleanup(ctx);
        }
    }
}
