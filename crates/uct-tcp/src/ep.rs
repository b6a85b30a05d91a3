//! The tcp endpoint: checks each operation's arguments, encodes its frame and posts it on the
//! connection (`proto::Conn`), which it shares with the interface.

use std::net::SocketAddrV4;
use std::sync::MutexGuard;

use rucx_ucs::{Error, MemoryType, Result};
use rucx_uct::iface::{AM_ID_MAX, check_packed};
use rucx_uct::{AmId, Endpoint, Iov, OpStatus, RemoteKey};

use crate::iface::SharedConn;
use crate::md::{TcpReg, TcpRkey};
use crate::proto::{Conn, Part, PendKind, lock};
use crate::sock::FdSock;
use crate::wire::{self, Kind};

/// An endpoint: our side of a connection to a peer interface.
#[derive(Debug)]
pub struct TcpEndpoint {
    conn: SharedConn,
    scratch: Vec<u8>,
}

fn check_am_id(id: AmId) -> Result<()> {
    if usize::from(id) >= AM_ID_MAX {
        return Err(Error::InvalidParam(format!(
            "active message id {id} is out of range (0..{AM_ID_MAX})"
        )));
    }
    Ok(())
}

/// Validate a zero-copy iov: every entry a host registration of the tcp domain that covers
/// it, at most `max_len` bytes in all.
fn check_iov(iov: &[Iov<'_>], max_len: usize, what: &str) -> Result<usize> {
    let total = Iov::check_all(iov, wire::MAX_IOV)?;
    for v in iov {
        if v.memh.inner::<TcpReg>().is_none() || v.memh.region().mem_type != MemoryType::Host {
            return Err(Error::InvalidParam(format!(
                "{what}: buffer {:#x}+{} is registered with {} ({} memory); tcp needs a host \
                 registration of the tcp domain",
                v.addr,
                v.len,
                v.memh.domain(),
                v.memh.region().mem_type
            )));
        }
    }
    if total > max_len {
        return Err(Error::InvalidParam(format!(
            "{what} of {total} bytes exceeds tcp's limit of {max_len} bytes"
        )));
    }
    Ok(total)
}

fn tcp_rkey(rkey: &RemoteKey) -> Result<TcpRkey> {
    rkey.inner::<TcpRkey>()
        .copied()
        .ok_or_else(|| Error::InvalidRkey {
            domain: "tcp".into(),
            reason: format!(
                "remote key was unpacked by domain {}, not tcp",
                rkey.domain()
            ),
        })
}

impl TcpEndpoint {
    pub(crate) fn new(conn: SharedConn) -> TcpEndpoint {
        TcpEndpoint {
            conn,
            scratch: vec![0u8; wire::AM_MAX_BCOPY],
        }
    }

    fn conn(&self) -> MutexGuard<'_, Conn<FdSock>> {
        lock(&self.conn)
    }

    /// The peer's listening address.
    pub fn peer(&self) -> Option<SocketAddrV4> {
        self.conn().peer
    }

    /// Post a request that the peer answers; `token` completes with the answer.
    fn request(&self, parts: &[Part<'_>], token: Option<u64>, kind: PendKind) -> Result<OpStatus> {
        self.conn().request(parts, token, kind)
    }

    fn rma(
        &mut self,
        kind: Kind,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        let what = if kind == Kind::Put {
            "put_zcopy"
        } else {
            "get_zcopy"
        };
        let total = check_iov(iov, wire::RMA_MAX_ZCOPY, what)?;
        let k = tcp_rkey(rkey)?;
        rkey.check(remote_addr, total as u64)?;
        let op = self.conn().ops.next_op();
        if kind == Kind::Put {
            let head = wire::put_head(op, k.md_id, k.reg_id, remote_addr, total);
            let mut parts = Vec::with_capacity(1 + iov.len());
            parts.push(Part::Bytes(&head));
            parts.extend(iov.iter().map(|v| Part::Mem(v.memh, v.addr, v.len)));
            self.request(&parts, Some(token), PendKind::Put)
        } else {
            let f = wire::words_frame(
                Kind::GetReq,
                &[op, k.md_id, k.reg_id, remote_addr, total as u64],
                &[],
            );
            let dst = iov
                .iter()
                .map(|v| (v.memh.clone(), v.addr, v.len))
                .collect();
            self.request(
                &[Part::Bytes(&f)],
                Some(token),
                PendKind::Get { dst, len: total },
            )
        }
    }
}

impl Endpoint for TcpEndpoint {
    fn am_short(&mut self, id: AmId, header: u64, payload: &[u8]) -> Result<()> {
        check_am_id(id)?;
        if payload.len() > wire::AM_MAX_SHORT {
            return Err(Error::InvalidParam(format!(
                "am_short payload of {} bytes exceeds tcp's limit of {} bytes",
                payload.len(),
                wire::AM_MAX_SHORT
            )));
        }
        let mut head = [0u8; wire::HDR_LEN + 8];
        head[..wire::HDR_LEN].copy_from_slice(&wire::header(Kind::Am, id, 8 + payload.len()));
        head[wire::HDR_LEN..].copy_from_slice(&header.to_le_bytes());
        self.conn()
            .post(&[Part::Bytes(&head), Part::Bytes(payload)], None)?;
        Ok(())
    }

    /// One `sendmsg` of two pieces, as `am_short`: the frame header, `header` and `word`
    /// joined on the stack, then `rest` from the caller (the default joins `word` and `rest`
    /// in `scratch` first, a copy of the whole payload per message).
    fn am_short_word(
        &mut self,
        id: AmId,
        header: u64,
        word: u64,
        rest: &[u8],
        _scratch: &mut Vec<u8>,
    ) -> Result<()> {
        check_am_id(id)?;
        if 8 + rest.len() > wire::AM_MAX_SHORT {
            return Err(Error::InvalidParam(format!(
                "am_short payload of {} bytes exceeds tcp's limit of {} bytes",
                8 + rest.len(),
                wire::AM_MAX_SHORT
            )));
        }
        let mut head = [0u8; wire::HDR_LEN + 16];
        head[..wire::HDR_LEN].copy_from_slice(&wire::header(Kind::Am, id, 16 + rest.len()));
        head[wire::HDR_LEN..wire::HDR_LEN + 8].copy_from_slice(&header.to_le_bytes());
        head[wire::HDR_LEN + 8..].copy_from_slice(&word.to_le_bytes());
        self.conn()
            .post(&[Part::Bytes(&head), Part::Bytes(rest)], None)?;
        Ok(())
    }

    fn am_bcopy(&mut self, id: AmId, pack: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<usize> {
        check_am_id(id)?;
        self.conn().can_queue(wire::HDR_LEN + wire::AM_MAX_BCOPY)?;
        let n = check_packed(pack(&mut self.scratch), wire::AM_MAX_BCOPY, "tcp")?;
        let h = wire::header(Kind::Am, id, n);
        let data = &self.scratch[..n];
        lock(&self.conn).post(&[Part::Bytes(&h), Part::Bytes(data)], None)?;
        Ok(n)
    }

    fn am_zcopy(
        &mut self,
        id: AmId,
        header: &[u8],
        iov: &[Iov<'_>],
        token: u64,
    ) -> Result<OpStatus> {
        check_am_id(id)?;
        if header.len() > wire::AM_MAX_HDR {
            return Err(Error::InvalidParam(format!(
                "am_zcopy header of {} bytes exceeds tcp's limit of {} bytes",
                header.len(),
                wire::AM_MAX_HDR
            )));
        }
        let total = check_iov(iov, wire::AM_MAX_ZCOPY, "am_zcopy")?;
        let h = wire::header(Kind::Am, id, header.len() + total);
        let mut parts = Vec::with_capacity(2 + iov.len());
        parts.push(Part::Bytes(&h));
        parts.push(Part::Bytes(header));
        parts.extend(iov.iter().map(|v| Part::Mem(v.memh, v.addr, v.len)));
        if self.conn().post(&parts, Some(token))? {
            Ok(OpStatus::Done)
        } else {
            Ok(OpStatus::InProgress)
        }
    }

    fn put_short(&mut self, data: &[u8], remote_addr: u64, rkey: &RemoteKey) -> Result<()> {
        if data.len() > wire::PUT_MAX_SHORT {
            return Err(Error::InvalidParam(format!(
                "put_short of {} bytes exceeds tcp's limit of {} bytes",
                data.len(),
                wire::PUT_MAX_SHORT
            )));
        }
        let k = tcp_rkey(rkey)?;
        rkey.check(remote_addr, data.len() as u64)?;
        let op = self.conn().ops.next_op();
        let head = wire::put_head(op, k.md_id, k.reg_id, remote_addr, data.len());
        self.request(
            &[Part::Bytes(&head), Part::Bytes(data)],
            None,
            PendKind::Put,
        )?;
        Ok(())
    }

    fn put_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(Kind::Put, iov, remote_addr, rkey, token)
    }

    fn get_zcopy(
        &mut self,
        iov: &[Iov<'_>],
        remote_addr: u64,
        rkey: &RemoteKey,
        token: u64,
    ) -> Result<OpStatus> {
        self.rma(Kind::GetReq, iov, remote_addr, rkey, token)
    }

    fn flush(&mut self, token: u64) -> Result<OpStatus> {
        {
            let mut c = self.conn();
            c.usable()?;
            if c.ops.all_answered() {
                return Ok(OpStatus::Done);
            }
            // Nothing posted since the last request: its answer (the peer answers in order)
            // completes the flush too, with no `Flush` frame and no answer of its own on the
            // wire (a rendezvous write and its flush: one frame each way, not two).
            if c.ops.flush_behind_last(token) {
                return Ok(OpStatus::InProgress);
            }
        }
        let op = self.conn().ops.next_op();
        let f = wire::words_frame(Kind::Flush, &[op], &[]);
        self.request(&[Part::Bytes(&f)], Some(token), PendKind::Flush)
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        // What was posted is still sent (the interface drains the queue); nothing more is
        // reported for this endpoint, and the peer learns that our side is done.
        self.conn().endpoint_gone();
    }
}
