//! What the worker's files and the protocols' files share: the state's types, the protocols'
//! request states, and the few outside names every one of them uses.

pub(crate) use std::collections::VecDeque;
pub(crate) use std::fmt;
pub(crate) use std::time::{Duration, Instant};

pub(crate) use rucx_ucs::{Error, MemoryType, Result};
pub(crate) use rucx_uct::{
    AmId, Endpoint, EpParams, Event, Iface, IfaceCaps, Iov, MemHandle, MemRegion, OpStatus,
    RemoteKey,
};
pub(crate) use rustc_hash::FxHashMap;

pub(crate) use crate::address::WorkerAddress;
pub(crate) use crate::buf::{RecvBuf, SendBuf};
pub(crate) use crate::context::RegGuard;
pub(crate) use crate::matching::Tag;
pub(crate) use crate::plan::{self, EpPlan, LaneCand, MemKey, Op, RecvStep};
pub(crate) use crate::proto::gpu::*;
pub(crate) use crate::proto::io::ProtoIo;
pub(crate) use crate::proto::rma::*;
pub(crate) use crate::proto::rndv::*;
pub(crate) use crate::proto::{self, Proto};
pub(crate) use crate::spare::Pooled;
pub(crate) use crate::wire::{self, Msg, MsgKind, NamedKey};

pub(crate) use super::direct::Waiter;
pub(crate) use super::state::*;
pub(crate) use super::{AmMessage, Completion, EpId, Posted, RkeyBundle, Worker, liveness};
