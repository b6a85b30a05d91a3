//! Peers: wire-up, the lanes each endpoint connects, planning and re-planning (after a demotion
//! or a local change), and a peer's failure.

use crate::worker::prelude::*;

/// How long progress waits for the copies of requests a peer's failure ended
/// ([`State::settle_failed_copies`]): copies of one staging fragment take microseconds.
const FAILED_COPY_WAIT: Duration = Duration::from_millis(100);

impl State {
    /// Find or create the peer for a remote worker (no uct endpoints yet; lanes are chosen
    /// when it is connected, where the interfaces can judge reachability).
    pub(crate) fn peer_for(&mut self, remote: WorkerAddress) -> Result<usize> {
        if let Some(&p) = self.by_uuid.get(&remote.uuid)
            && self.peers[p].failed.is_none()
            && self.peers[p].closed.is_none()
        {
            return Ok(p);
        }
        // New, or a reconnect after the old endpoint failed or was closed: a new endpoint, which
        // messages from that worker reach from now on.
        let p = self.peers.len();
        self.by_uuid.insert(remote.uuid, p);
        self.last_src.set(NO_LAST_SRC);
        self.peers.push(Peer::new(remote));
        Ok(p)
    }

    /// Find the peer's reachable interfaces, plan the endpoint (a deterministic function of
    /// both addresses, the transports' attributes and the registration view) and create the uct
    /// endpoints of the lanes the plan uses.
    /// Progress's work for a peer that is not settled: connect it (failing it when that
    /// fails), connect the lanes its plan wants, send what waits in its queue.
    #[inline(never)]
    pub(crate) fn settle_peer(&mut self, p: usize, ifaces: &mut [Box<dyn Iface>]) {
        if !self.peers[p].connected
            && self.peers[p].failed.is_none()
            && !self.peers[p].cm_pending
            && let Err(e) = self.connect_peer(p, ifaces)
        {
            self.fail_peer(p, &e.to_string());
        }
        if self.peers[p].needs_lanes {
            self.connect_wanted(p, ifaces);
        }
        if !self.peers[p].queue.is_empty() {
            self.pump(p);
        }
    }

    pub(crate) fn connect_peer(&mut self, p: usize, ifaces: &mut [Box<dyn Iface>]) -> Result<()> {
        if self.peers[p].connected {
            return Ok(());
        }
        let remote = self.peers[p].remote.clone();
        let mut targets = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            // The copy engine works inside this process only; it is not a lane to peers.
            if self.copy.as_ref().is_some_and(|(c, _)| *c == i) {
                continue;
            }
            if let Some(entry) = remote.ifaces.iter().find(|e| {
                e.tl_name == slot.attr.tl_name && ifaces[i].is_reachable(&e.dev_addr, &e.iface_addr)
            }) {
                targets.push((i, entry.clone()));
            }
        }
        self.peers[p].targets = targets;
        let plan = self.make_plan(p).map_err(|u| Error::Unsupported {
            what: format!("connecting to {}", remote.describe()),
            why: format!(
                "no transport reaches it (local: {:?}; remote: {:?}); check RUCX_TLS and the network",
                u.local,
                remote
                    .ifaces
                    .iter()
                    .map(|e| format!("{}/{}", e.tl_name, e.dev_name))
                    .collect::<Vec<_>>()
            ),
        })?;
        for i in plan.wanted.clone() {
            self.connect_lane(p, i, ifaces)?;
        }
        let peer = &mut self.peers[p];
        peer.am = plan.lanes.am;
        peer.connected = true;
        peer.plan_at = (u64::MAX, u64::MAX);
        // Introduce ourselves first on the AM lane, so replies can find us.
        let addr = self.address.pack();
        let (id, bytes) = Msg::Wireup {
            ep: p as u64,
            addr: &addr,
        }
        .encode();
        self.peers[p].queue.push_front(Pending::Ctrl { id, bytes });
        self.refresh_plan(p);
        self.offer_staging(p);
        Ok(())
    }

    /// Create the uct endpoint of local interface `i` to peer `p`.
    pub(crate) fn connect_lane(
        &mut self,
        p: usize,
        i: usize,
        ifaces: &mut [Box<dyn Iface>],
    ) -> Result<()> {
        if self.peers[p].eps.get_mut(&i).is_some() {
            return Ok(());
        }
        let Some((_, entry)) = self.peers[p].targets.iter().find(|(l, _)| *l == i) else {
            return Err(Error::Internal(format!("lane {i} does not reach ep{p}")));
        };
        let ep = ifaces[i].create_ep(&EpParams {
            dev_addr: entry.dev_addr.clone(),
            iface_addr: entry.iface_addr.clone(),
            user_id: p as u64,
        })?;
        self.peers[p].eps.insert(i, ep);
        // Polled on every progress call from now on (`active.rs`).
        self.active.mark(i);
        self.plan_gen += 1;
        Ok(())
    }

    /// Connect the lanes peer `p`'s plan wants (a demotion made a lane that was not in use the
    /// best one); a lane that cannot be connected is logged and left out.
    pub(crate) fn connect_wanted(&mut self, p: usize, ifaces: &mut [Box<dyn Iface>]) {
        self.peers[p].needs_lanes = false;
        for i in std::mem::take(&mut self.peers[p].plan.wanted) {
            if let Err(e) = self.connect_lane(p, i, ifaces) {
                tracing::info!(
                    "ep{p}: lane {}/{} not connected: {e}",
                    self.slots[i].attr.tl_name,
                    self.slots[i].attr.dev_name
                );
                self.peers[p].targets.retain(|(l, _)| *l != i);
                self.plan_gen += 1;
            }
        }
    }

    /// Have the progress loop connect `lane` to peer `p`, unless it is connected or asked for.
    pub(crate) fn want_lane(&mut self, p: usize, lane: usize) {
        let peer = &mut self.peers[p];
        if peer.eps.get_mut(&lane).is_none() && !peer.plan.wanted.contains(&lane) {
            peer.plan.wanted.push(lane);
            peer.needs_lanes = true;
        }
    }

    /// Plan for GPU memory `key` too (from now on, for every endpoint).
    pub(crate) fn note_gpu_key(&mut self, key: MemKey) {
        if !self.gpu_keys.contains(&key) {
            self.gpu_keys.push(key);
            self.plan_gen += 1;
        }
        // The first GPU buffer met: start making the staging its transfers may need.
        if key.mem.is_gpu()
            && self.staging.is_none()
            && let Some((mi, len)) = self.staging_ahead_wanted.take()
        {
            self.staging_ahead = crate::proto::gpu::staging::StagingMem::ahead(&self.ctx, mi, len);
            self.count("staging ahead started");
            // Offered at once (its shared allocation exists already): peers map and register
            // it while our helper page-locks it.
            self.offer_staging_all();
            self.take_held_offers();
        }
    }

    /// The plan of peer `p` as the planner makes it from the current state.
    pub(crate) fn make_plan(&self, p: usize) -> std::result::Result<EpPlan, plan::Unreachable> {
        let peer = &self.peers[p];
        let copy = self.copy.as_ref().map(|(c, _)| *c);
        let lanes: Vec<LaneCand> = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let md = self.ctx.domain(slot.md);
                LaneCand {
                    attr: slot.attr.clone(),
                    md: slot.md,
                    md_name: md.name().to_string(),
                    md_attr: md.attr().clone(),
                    remote_md: peer
                        .targets
                        .iter()
                        .find(|(l, _)| *l == i)
                        .map(|(_, e)| e.md_name.clone()),
                    connected: peer.eps.0.iter().any(|(l, _)| *l == i),
                    copy: copy == Some(i),
                }
            })
            .collect();
        plan::plan(plan::PlanInput {
            lanes: &lanes,
            reg: &self.ctx,
            cfg: &self.plan_cfg,
            gpu_keys: &self.gpu_keys,
            peer: &peer.remote.describe(),
        })
    }

    /// Re-plan peer `p` if the registration view (a demotion) or the local state changed.
    #[inline]
    pub(crate) fn refresh_plan(&mut self, p: usize) {
        let at = (self.ctx.epoch(), self.plan_gen);
        if self.peers[p].plan_at == at || !self.peers[p].connected {
            return;
        }
        self.replan(p, at);
    }

    #[cold]
    pub(crate) fn replan(&mut self, p: usize, at: (u64, u64)) {
        let plan = match self.make_plan(p) {
            Ok(plan) => plan,
            Err(u) => {
                self.fail_peer(
                    p,
                    &format!("no lane reaches the peer any more (local: {:?})", u.local),
                );
                return;
            }
        };
        let first = self.peers[p].plan_at.0 == u64::MAX;
        let changed = !first && self.peers[p].plan.tables != plan.tables;
        let demoted = !first && self.peers[p].plan_at.0 != at.0;
        self.peers[p].rma = plan.lanes.rma;
        self.peers[p].needs_lanes = !plan.wanted.is_empty();
        self.peers[p].plan = plan;
        self.peers[p].plan_at = at;
        if self.proto_info && (first || changed) || demoted && changed {
            let text = format!(
                "rucx ep{p} -> {}{}\n{}",
                self.peers[p].remote.describe(),
                if demoted {
                    " (re-planned after a demotion)"
                } else {
                    ""
                },
                self.peers[p].plan
            );
            if self.proto_info {
                eprintln!("{text}");
            } else {
                tracing::info!("\n{text}");
            }
        }
    }

    pub(crate) fn fail_peer(&mut self, p: usize, reason: &str) {
        let Some(peer) = self.peers.get(p) else {
            return;
        };
        let err = Error::EndpointFailure {
            peer: peer.remote.describe(),
            reason: reason.to_string(),
        };
        self.fail_peer_with(p, reason, err);
    }

    /// Peer `p` failed for `reason`: its requests end with `err`, which requests posted to it
    /// later get too, and which its error handler is told.
    pub(crate) fn fail_peer_with(&mut self, p: usize, reason: &str, err: Error) {
        let Some(peer) = self.peers.get(p) else {
            return;
        };
        if peer.failed.is_some() {
            return;
        }
        if self.closing {
            // The worker's owner is leaving (`Worker::set_closing`, as a job does after its
            // final barrier): peers going away now is the expected end, not news.
            tracing::debug!(
                "endpoint ep{p} to {} ended while closing: {reason}",
                peer.remote.describe()
            );
        } else {
            tracing::warn!(
                "endpoint ep{p} to {} failed: {reason}",
                peer.remote.describe()
            );
        }
        self.peers[p].failure = Some(err.clone());
        self.end_peer(p, reason, &err);
        // Reported to the error handler from progress (unless this worker is closing it).
        self.note_ep_failure(p, err);
    }

    /// Peer `p` is gone (failed or closed, for `reason`): every request bound to it ends with
    /// `err`, its queue and partial messages are dropped. Waiting stream receives end with
    /// [`Error::StreamIncomplete`] (how many bytes each holds, and `err`); stream bytes that
    /// arrived and no receive took stay receivable, as whole tag messages do.
    pub(crate) fn end_peer(&mut self, p: usize, reason: &str, err: &Error) {
        let (reqs, peer) = (&mut self.reqs, &mut self.peers[p]);
        peer.failed = Some(reason.to_string());
        peer.queue.clear();
        let mut io = StreamReqs::new(reqs, EpId::new(p, self.ep_base)).ended_by(err.clone());
        peer.stream_rx.end(&mut io);
        let uuid = peer.remote.uuid;
        let ended = io.ended;
        self.note_stream_ends(&ended);
        let ids: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.result.is_none())
            .filter(|(_, r)| match &r.kind {
                ReqKind::Send(s) => s.head.peer == p,
                ReqKind::Recv(rs) => rs.sender == Some(p),
                ReqKind::Rma(rm) => rm.peer == p,
            })
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            self.finish(id, Err(err.clone()));
            // Copies this process runs still touch its buffer: the next progress waits for
            // them, so that the request is reported ended with the failure
            // ([`Self::settle_failed_copies`]).
            if self.copies_in_flight(id) {
                self.failed_copies.push(id);
            }
        }
        // The staging fragments it was reading will not be acknowledged.
        self.release_staged_to(p);
        // Partial unexpected messages from it can never complete.
        self.matcher.drop_unexpected(|u| match u {
            Unexp::Eager {
                src, total, data, ..
            } => *src == p && data.len() < *total,
            Unexp::Rts { src, .. } => *src == p,
        });
        self.rx.retain(|(s, _), _| *s != uuid);
    }

    /// Wait for the copies this process runs (the copy lane, copy-engine lanes) that still
    /// touch the buffers of requests a peer's failure ended ([`Self::end_peer`]): such a copy
    /// always completes, whatever the peer does, and until it has the request cannot be
    /// reported (its buffer is still written or read). Waiting here, right after the events
    /// that brought the failure, a request bound to the failed peer is reported ended by the
    /// progress that handled the failure, not some later one. Only those lanes are progressed
    /// (their other completions are handled as usual); past [`FAILED_COPY_WAIT`] the rest are
    /// left to later progress (each is reported once its copies completed). Returns the events
    /// handled.
    #[cold]
    #[inline(never)]
    pub(crate) fn settle_failed_copies(&mut self, ifaces: &mut [Box<dyn Iface>]) -> usize {
        let copy = self.copy.as_ref().map(|c| c.0);
        let local: Vec<usize> = (0..ifaces.len())
            .filter(|&i| Some(i) == copy || self.lane_local(i))
            .collect();
        let mut n = 0;
        let mut deadline = None;
        loop {
            let mut ids = std::mem::take(&mut self.failed_copies);
            ids.retain(|&id| self.copies_in_flight(id));
            if ids.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= *deadline.get_or_insert(now + FAILED_COPY_WAIT) {
                tracing::debug!(
                    "{} requests ended by a peer's failure still wait for their copies",
                    ids.len()
                );
                break;
            }
            // Requests ended while handling these events join the list.
            self.failed_copies.extend(ids);
            for &i in &local {
                n += ifaces[i].progress(&mut |ev| self.on_event(i, ev));
            }
            if !self.done_q.is_empty() {
                n += self.run_done_q();
            }
        }
        n
    }
}
