//! The memory-event hooks Open MPI's common/ucx calls (`ucm_*`, from `libucm` in UCX).
//!
//! Open MPI tells UCX which memory its own hooks watch (`ucm_set_external_event`) and reports
//! unmapped ranges (`ucm_vm_munmap`) so that UCX can drop registrations of freed memory. On the
//! host transports rucx has here (shared memory, TCP) a host registration only records an
//! address range, nothing is pinned, so a cached one of freed memory is harmless; GPU
//! registrations are reused only while the domain confirms the allocation is unchanged. The
//! events are accepted and ignored, and the tests report success so that Open MPI does not warn.
//! Verbs registrations (ib) pin pages and would need them: a known gap (docs/c-abi.md).

use std::ffi::{c_int, c_void};

use crate::types::*;

/// `void ucm_set_external_event(int events)`.
#[unsafe(no_mangle)]
pub extern "C" fn ucm_set_external_event(_events: c_int) {}

/// `void ucm_unset_external_event(int events)`.
#[unsafe(no_mangle)]
pub extern "C" fn ucm_unset_external_event(_events: c_int) {}

/// `ucs_status_t ucm_test_events(int events)`.
#[unsafe(no_mangle)]
pub extern "C" fn ucm_test_events(_events: c_int) -> Status {
    UCS_OK
}

/// `ucs_status_t ucm_test_external_events(int events)`.
#[unsafe(no_mangle)]
pub extern "C" fn ucm_test_external_events(_events: c_int) -> Status {
    UCS_OK
}

/// `void ucm_vm_munmap(void *addr, size_t length)`.
#[unsafe(no_mangle)]
pub extern "C" fn ucm_vm_munmap(addr: *mut c_void, length: usize) {
    crate::memtype::forget(addr as usize, length);
}
