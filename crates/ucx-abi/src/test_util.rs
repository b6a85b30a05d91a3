//! What the in-process tests of the C ABI share.

use crate::endpoint::{AbiEp, ucp_ep_create};
use crate::types::*;
use crate::worker::*;

/// Connect two workers both ways by worker address, as a C caller does: `ep[i]` is worker i's
/// endpoint to worker 1 - i. Panics unless every call succeeds.
///
/// # Safety
/// Both workers are live.
pub unsafe fn connect_both(w: [*mut AbiWorker; 2]) -> [*mut AbiEp; 2] {
    let mut ep = [std::ptr::null_mut(); 2];
    for i in 0..2 {
        let (mut addr, mut len) = (std::ptr::null_mut(), 0);
        // SAFETY: live workers (the caller's promise), valid out pointers; the address is
        // released after use.
        unsafe {
            assert_eq!(
                ucp_worker_get_address(w[1 - i], &mut addr, &mut len),
                UCS_OK
            );
            let mut p: EpParams = std::mem::zeroed();
            p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
            p.address = addr;
            assert_eq!(ucp_ep_create(w[i], &p, &mut ep[i]), UCS_OK);
            ucp_worker_release_address(w[1 - i], addr);
        }
    }
    ep
}
