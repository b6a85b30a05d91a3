//! What the client/server (`listener.rs`), active-message (`am.rs`) and wake-up (`wait.rs`)
//! calls keep per worker, one field of [`AbiWorker`], and the one thing they add to
//! `ucp_worker_progress`: looking at the worker's listeners (a single test when it has none).

use std::os::fd::RawFd;

use crate::am::AmState;
use crate::listener::Listeners;
use crate::wait::Wake;
use crate::worker::AbiWorker;

#[derive(Debug, Default)]
pub struct Extra {
    pub listeners: Listeners,
    pub am: AmState,
    pub wake: Wake,
    pub streams: crate::stream::StreamState,
}

impl Extra {
    /// After the worker's own progress: hand connection requests to their listeners'
    /// handlers; how many.
    #[inline(always)]
    pub fn progress(&self, w: &AbiWorker) -> usize {
        if self.listeners.any() {
            self.listeners.progress(w)
        } else {
            0
        }
    }

    /// The descriptors of the worker's listeners.
    pub fn listener_fds(&self) -> Vec<RawFd> {
        self.listeners.fds()
    }
}
