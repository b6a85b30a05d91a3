//! Sim interfaces and endpoints.

use rucx_ucs::{Error, Result};
use rucx_uct::iface::{AM_ID_MAX, check_packed};
use rucx_uct::rkey::{self, Reader};
use rucx_uct::{
    AmId, DeviceType, Endpoint, EpParams, Event, Iface, IfaceAttr, IfaceCaps, IfaceLimits, Iov,
    OpStatus, PerfModel, RemoteKey,
};

use crate::COMPONENT;
use crate::fabric::{Fabric, LaneKind, Payload, kind_code, kind_from_code, limits};
use crate::mem;

fn attr(kind: LaneKind, limits: IfaceLimits) -> IfaceAttr {
    let host_caps = IfaceCaps::AM_SHORT
        | IfaceCaps::AM_BCOPY
        | IfaceCaps::AM_ZCOPY
        | IfaceCaps::PUT_SHORT
        | IfaceCaps::PUT_ZCOPY
        | IfaceCaps::GET_ZCOPY
        | IfaceCaps::CONNECT_TO_IFACE
        | IfaceCaps::ERRHANDLE_PEER_FAILURE;
    let (dev_type, caps, perf) = match kind {
        // posix's model.
        LaneKind::Shm => (
            DeviceType::IntraNode,
            host_caps,
            PerfModel {
                latency_ns: 150.0,
                overhead_ns: 30.0,
                bandwidth: 6.0e9,
            },
        ),
        // tcp over loopback.
        LaneKind::Net => (
            DeviceType::Network,
            host_caps,
            PerfModel {
                latency_ns: 5_000.0,
                overhead_ns: 1_000.0,
                bandwidth: 2.0e9,
            },
        ),
        // cuda_ipc's model.
        LaneKind::Ipc => (
            DeviceType::IntraNode,
            IfaceCaps::PUT_ZCOPY
                | IfaceCaps::GET_ZCOPY
                | IfaceCaps::CONNECT_TO_IFACE
                | IfaceCaps::ERRHANDLE_PEER_FAILURE
                | IfaceCaps::LOCAL_COPY,
            PerfModel {
                latency_ns: 10_000.0,
                overhead_ns: 3_000.0,
                bandwidth: 350e9,
            },
        ),
        // cuda_copy's model.
        LaneKind::Copy => (
            DeviceType::Accelerator,
            IfaceCaps::PUT_SHORT
                | IfaceCaps::PUT_ZCOPY
                | IfaceCaps::GET_ZCOPY
                | IfaceCaps::CONNECT_TO_IFACE
                | IfaceCaps::LOCAL_COPY,
            PerfModel {
                latency_ns: 8_000.0,
                overhead_ns: 2_000.0,
                bandwidth: 50e9,
            },
        ),
    };
    IfaceAttr {
        tl_name: kind.name().into(),
        dev_name: kind.device().into(),
        dev_type,
        sys_device: None,
        caps,
        limits,
        perf,
        priority: 0,
        device_addr_len: rkey::pack(COMPONENT, &[0u8; 16]).len(),
        iface_addr_len: rkey::pack(COMPONENT, &[0u8; 9]).len(),
        ep_addr_len: 0,
        max_eps: None,
    }
}

fn dev_addr(fabric_id: u64, node: usize) -> Vec<u8> {
    let mut p = fabric_id.to_le_bytes().to_vec();
    p.extend_from_slice(&(node as u64).to_le_bytes());
    rkey::pack(COMPONENT, &p)
}

fn iface_addr(id: usize, kind: LaneKind) -> Vec<u8> {
    let mut p = (id as u64).to_le_bytes().to_vec();
    p.push(kind_code(kind));
    rkey::pack(COMPONENT, &p)
}

fn parse_dev(blob: &[u8]) -> Result<(u64, usize)> {
    let p = rkey::unpack(COMPONENT, "sim device address", blob)
        .map_err(|e| Error::InvalidAddress(e.to_string()))?;
    let mut r = Reader::new(p, "sim device address");
    let (f, n) = (r.u64()?, r.u64()?);
    r.finish()?;
    Ok((f, n as usize))
}

fn parse_iface(blob: &[u8]) -> Result<(usize, LaneKind)> {
    let p = rkey::unpack(COMPONENT, "sim interface address", blob)
        .map_err(|e| Error::InvalidAddress(e.to_string()))?;
    let mut r = Reader::new(p, "sim interface address");
    let (id, k) = (r.u64()?, r.u8()?);
    r.finish()?;
    let k = kind_from_code(k)
        .ok_or_else(|| Error::InvalidAddress(format!("sim interface address: lane code {k}")))?;
    Ok((id as usize, k))
}

/// A sim interface: one lane kind of one node.
#[derive(Debug)]
pub struct SimIface {
    fabric: Fabric,
    id: usize,
    node: usize,
    kind: LaneKind,
    fabric_id: u64,
    attr: IfaceAttr,
}

impl SimIface {
    pub(crate) fn new(fabric: Fabric, node: usize, kind: LaneKind) -> SimIface {
        let (id, fabric_id, lim) = {
            let mut st = fabric.lock();
            let lim = limits(&st.spec, kind);
            (st.new_iface(node, kind), st.id, lim)
        };
        SimIface {
            fabric,
            id,
            node,
            kind,
            fabric_id,
            attr: attr(kind, lim),
        }
    }

    /// The interface (and node) an address names, when reachable from here.
    fn target(&self, dev: &[u8], iface: &[u8]) -> Result<usize> {
        let (fid, node) = parse_dev(dev)?;
        let (id, kind) = parse_iface(iface)?;
        if fid != self.fabric_id {
            return Err(Error::InvalidAddress(format!(
                "address of sim fabric {fid}; this is fabric {}",
                self.fabric_id
            )));
        }
        if kind != self.kind {
            return Err(Error::InvalidAddress(format!(
                "address of a {kind} interface; this is {}",
                self.kind
            )));
        }
        let st = self.fabric.lock();
        match st.ifaces.get(id) {
            Some(s) if s.node == node && s.kind == kind => {}
            _ => {
                return Err(Error::InvalidAddress(format!(
                    "no {kind} interface {id} on node {node} of this fabric"
                )));
            }
        }
        if kind == LaneKind::Copy && node != self.node {
            return Err(Error::InvalidAddress(
                "the copy lane reaches its own worker only".into(),
            ));
        }
        Ok(id)
    }
}

impl Iface for SimIface {
    fn attr(&self) -> &IfaceAttr {
        &self.attr
    }

    fn device_address(&self) -> Vec<u8> {
        dev_addr(self.fabric_id, self.node)
    }

    fn iface_address(&self) -> Vec<u8> {
        iface_addr(self.id, self.kind)
    }

    fn is_reachable(&self, dev_addr: &[u8], iface_addr: &[u8]) -> bool {
        self.target(dev_addr, iface_addr).is_ok()
    }

    fn create_ep(&mut self, params: &EpParams) -> Result<Box<dyn Endpoint>> {
        let target = self.target(&params.dev_addr, &params.iface_addr)?;
        let ep = self.fabric.lock().new_ep(self.id, target, params.user_id);
        Ok(Box::new(SimEp {
            fabric: self.fabric.clone(),
            ep,
            kind: self.kind,
            caps: self.attr.caps,
            limits: self.attr.limits,
        }))
    }

    fn progress(&mut self, sink: &mut dyn FnMut(Event<'_>)) -> usize {
        let budget = self.fabric.lock().start_progress(self.id);
        let mut n = 0;
        while n < budget {
            // One item at a time, and the lock released before the sink runs: it may post.
            let Some(item) = self.fabric.lock().pop(self.id) else {
                break;
            };
            match item {
                Payload::Am { id, data } => sink(Event::Am { id, data: &data }),
                Payload::Completion { token, result } => sink(Event::Completion { token, result }),
                Payload::EpError { user_id, error } => sink(Event::EpError { user_id, error }),
            }
            n += 1;
        }
        n
    }
}

/// A sim endpoint.
#[derive(Debug)]
pub struct SimEp {
    fabric: Fabric,
    ep: usize,
    kind: LaneKind,
    caps: IfaceCaps,
    limits: IfaceLimits,
}

impl SimEp {
    fn need(&self, cap: IfaceCaps, what: &str) -> Result<()> {
        if self.caps.contains(cap) {
            return Ok(());
        }
        let mut st = self.fabric.lock();
        Err(st.limits_violation(self.ep, format!("{what} is not an operation of this lane")))
    }

    fn over(&self, what: &str, n: usize, limit: usize) -> Result<()> {
        if n <= limit {
            return Ok(());
        }
        let mut st = self.fabric.lock();
        Err(st.limits_violation(
            self.ep,
            format!("{what} of {n} bytes exceeds the lane's limit of {limit}"),
        ))
    }

    fn am_id(&self, id: AmId) -> Result<()> {
        if usize::from(id) < AM_ID_MAX {
            return Ok(());
        }
        let mut st = self.fabric.lock();
        Err(st.limits_violation(self.ep, format!("active message id {id} is out of range")))
    }

    fn rma(
        &mut self,
        put: bool,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        let what = if put { "put_zcopy" } else { "get_zcopy" };
        self.need(
            if put {
                IfaceCaps::PUT_ZCOPY
            } else {
                IfaceCaps::GET_ZCOPY
            },
            what,
        )?;
        let max = if put {
            self.limits.put_max_zcopy
        } else {
            self.limits.get_max_zcopy
        };
        let mut st = self.fabric.lock();
        let local = st.local_spans(self.ep, iov, self.limits.max_iov, what)?;
        let total: usize = local.iter().map(|s| s.len()).sum();
        if total > max {
            return Err(st.limits_violation(
                self.ep,
                format!("{what} of {total} bytes exceeds the lane's limit of {max}"),
            ));
        }
        let remote = st.remote_span(self.ep, rkey, remote_addr, total, what)?;
        st.pre_op(self.ep, what)?;
        if st.completion_fails(self.ep) {
            return Ok(st.complete_failed(self.ep, token, what));
        }
        let mut off = 0;
        for l in local {
            let r = remote.sub(off, l.len());
            if put {
                mem::copy(l, r);
            } else {
                mem::copy(r, l);
            }
            off += l.len();
        }
        Ok(st.complete(self.ep, token, false))
    }
}

impl Endpoint for SimEp {
    fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()> {
        self.need(IfaceCaps::AM_SHORT, "am_short")?;
        self.am_id(id)?;
        self.over("am_short payload", payload.len(), self.limits.am_max_short)?;
        let mut st = self.fabric.lock();
        st.pre_op(self.ep, "am_short")?;
        let mut data = Vec::with_capacity(8 + payload.len());
        data.extend_from_slice(&header.to_le_bytes());
        data.extend_from_slice(payload);
        st.send_am(self.ep, id, data);
        Ok(())
    }

    fn am_bcopy(&mut self, id: AmId, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        self.need(IfaceCaps::AM_BCOPY, "am_bcopy")?;
        self.am_id(id)?;
        self.fabric.lock().pre_op(self.ep, "am_bcopy")?;
        // The caller's packer runs without the fabric's lock.
        let mut buf = vec![0u8; self.limits.am_max_bcopy];
        let n = match check_packed(pack(&mut buf), buf.len(), self.kind.name()) {
            Ok(n) => n,
            Err(e) => return Err(self.fabric.lock().limits_violation(self.ep, e.to_string())),
        };
        buf.truncate(n);
        self.fabric.lock().send_am(self.ep, id, buf);
        Ok(n)
    }

    fn am_zcopy(
        &mut self,
        id: AmId,
        header: &[u8],
        iov: &[Iov<'_>],
        token: u64,
    ) -> Result<OpStatus> {
        self.need(IfaceCaps::AM_ZCOPY, "am_zcopy")?;
        self.am_id(id)?;
        self.over("am_zcopy header", header.len(), self.limits.am_max_hdr)?;
        let mut st = self.fabric.lock();
        let spans = st.local_spans(self.ep, iov, self.limits.max_iov, "am_zcopy")?;
        let total: usize = spans.iter().map(|s| s.len()).sum();
        if total > self.limits.am_max_zcopy {
            return Err(st.limits_violation(
                self.ep,
                format!(
                    "am_zcopy payload of {total} bytes exceeds the lane's limit of {}",
                    self.limits.am_max_zcopy
                ),
            ));
        }
        st.pre_op(self.ep, "am_zcopy")?;
        if st.completion_fails(self.ep) {
            return Ok(st.complete_failed(self.ep, token, "am_zcopy"));
        }
        let mut data = Vec::with_capacity(header.len() + total);
        data.extend_from_slice(header);
        for s in spans {
            mem::read_into(s, &mut data);
        }
        st.send_am(self.ep, id, data);
        Ok(st.complete(self.ep, token, false))
    }

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        self.need(IfaceCaps::PUT_SHORT, "put_short")?;
        self.over("put_short", data.len(), self.limits.put_max_short)?;
        let mut st = self.fabric.lock();
        let dst = st.remote_span(self.ep, rkey, remote_addr, data.len(), "put_short")?;
        st.pre_op(self.ep, "put_short")?;
        mem::write_from(data, dst);
        Ok(())
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(true, iov, remote_addr, rkey, token)
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(false, iov, remote_addr, rkey, token)
    }

    fn flush(&mut self, token: u64) -> Result<OpStatus> {
        let mut st = self.fabric.lock();
        st.pre_op(self.ep, "flush")?;
        Ok(st.complete(self.ep, token, true))
    }
}
