//! Memory regions: what a region holds of its PD and of its memory, its keys and generation,
//! and its end (deregistration once the work in flight is done: [`Mr::deregister`], or a
//! bounded wait on drop).

use super::buffer::HostBuffer;
use super::inflight::{InFlight, PdQps, SqWatch};
use crate::backend::context::Context;
use crate::backend::seam::PdOps;
use crate::backend::GpuRegPath;
use crate::gpu::DeviceMem;
use crate::Error;
use std::any::Any;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use verbs::{Access, MemKind};

/// What a region holds of its PD: the device, the PD's device object and its QPs (not the
/// registration cache, which holds regions itself).
#[derive(Clone)]
pub(crate) struct RegionPd {
    pub(crate) ctx: Context,
    /// The device's PD (a region's registration needs it alive).
    pub(crate) _dev: Arc<dyn PdOps>,
    pub(crate) qps: Arc<PdQps>,
}

/// What a region keeps alive.
#[derive(Debug)]
pub(crate) enum Keep {
    /// Nothing: the caller keeps the memory valid.
    Nothing,
    Host(#[allow(dead_code)] HostBuffer),
    Device(#[allow(dead_code)] DeviceMem),
}

/// A registered memory region.
///
/// Dropping it waits (at most 100 ms, where the device shows its progress) for the WQEs posted
/// before, then deregisters it, with a warning if some are still in flight; [`Mr::deregister`]
/// waits as long as asked and gives the region back instead.
pub struct Mr {
    pub(super) pd: RegionPd,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) access: Access,
    pub(super) kind: MemKind,
    /// How GPU memory was registered on an rdma-core device.
    pub(super) gpu_path: Option<GpuRegPath>,
    /// This registration's serial number ([`Mr::generation`]).
    pub(super) generation: u32,
    /// Set when the region's drop need not look for work in flight (already waited for).
    pub(super) quiet: bool,
    /// The device's registration, deregistered when it drops (after the wait in `drop`,
    /// before the memory `_keep` holds).
    pub(super) _registration: Box<dyn Any + Send + Sync>,
    pub(super) _keep: Keep,
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("ctx", &self.pd.ctx)
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("access", &self.access)
            .field("kind", &self.kind)
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .field("generation", &self.generation)
            .field("keep", &self._keep)
            .finish()
    }
}

/// Registration serial numbers ([`Mr::generation`]; 0 is never used: it means "unknown" in a
/// [`crate::RemoteMemory`]).
static NEXT_GENERATION: AtomicU32 = AtomicU32::new(1);

pub(super) fn next_generation() -> u32 {
    loop {
        let g = NEXT_GENERATION.fetch_add(1, Ordering::Relaxed);
        if g != 0 {
            return g;
        }
    }
}

impl Mr {
    /// The local key.
    pub fn lkey(&self) -> prm::Lkey {
        prm::Lkey(self.lkey)
    }
    /// The remote key (a capability: hand it out only on purpose).
    pub fn rkey(&self) -> prm::Rkey {
        prm::Rkey(self.rkey)
    }
    /// First byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Rights.
    pub fn access(&self) -> Access {
        self.access
    }
    /// Where its bytes live: host memory or GPU memory.
    pub fn kind(&self) -> MemKind {
        self.kind
    }
    /// For GPU memory on an rdma-core device: whether it was registered through a dma-buf or
    /// through nvidia-peermem (`None` elsewhere).
    pub fn gpu_path(&self) -> Option<GpuRegPath> {
        self.gpu_path
    }
    /// An SGE over `off..off+len` of this region.
    pub fn sge(&self, off: u64, len: u32) -> prm::Sge {
        prm::Sge {
            addr: self.addr + off,
            len,
            lkey: self.lkey(),
        }
    }
    /// The remote address of `off` in this region, with its rkey.
    pub fn remote(&self, off: u64) -> prm::RemoteAddr {
        prm::RemoteAddr {
            addr: self.addr + off,
            rkey: self.rkey(),
        }
    }
    /// This registration's generation: a serial number, unique within the process (never 0),
    /// that no other registration has, not even one of the same memory. A
    /// [`crate::RemoteMemory`] made by [`crate::RemoteMemory::export_mr`] carries it, so a
    /// peer can tell a descriptor of this registration from one of an earlier registration of
    /// the same address (whose rkey is dead).
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Deregisters the region once the WQEs posted before this call are done: waits, at most
    /// `timeout`, until every QP of the region's PD has executed (or flushed, or dropped by a
    /// reset) the send WQEs rung before the call — by a CPU initiator, a kernel through an
    /// exported descriptor, or the CPU proxy — then deregisters and returns `Ok`.
    ///
    /// When the wait ends with WQEs still in flight, nothing is deregistered: the region comes
    /// back inside the [`DeregisterError`] ([`DeregisterError::into_mr`]), with the QPs still
    /// busy ([`InFlight`]); drop it to deregister anyway (the WQEs that use it then complete
    /// with error CQEs), or keep it and try again. Converting the error into [`Error`]
    /// (`?`) drops the region.
    ///
    /// What it watches is the device's SQ consumer index against the producer index rung (or
    /// published to the CPU proxy) at the call; WQEs posted after the call are not waited for.
    /// A destroyed QP has nothing in flight, nor one moved to RESET (which drops its WQEs);
    /// WQEs posted to a QP below RTS wait until it reaches RTS (so the wait runs out unless
    /// something moves it there, or resets it). On the mlx5
    /// backend the device's SQ progress cannot be observed: a QP of the PD that is not in
    /// RESET is reported at once ([`QpInFlight::blocks`](crate::QpInFlight::blocks) is `None`) without waiting. Over the
    /// soft NIC's wire (a peer in another process) a WQE counts once its answer (ACK, READ
    /// response, atomic ACK) has arrived.
    pub fn deregister(mut self, timeout: Duration) -> Result<(), DeregisterError> {
        match self.wait_idle(timeout) {
            Ok(()) => {
                self.quiet = true;
                Ok(())
            }
            Err(report) => Err(DeregisterError {
                mr: Box::new(self),
                report,
            }),
        }
    }

    /// Waits, at most `timeout`, until every QP of the region's PD has executed the send WQEs
    /// rung before the call ([`Mr::deregister`] says what counts); returns at once what is in
    /// flight when only unobservable (mlx5) QPs are left.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> Result<(), InFlight> {
        self.wait_for(timeout, true)
    }

    /// Waits, at most `timeout`, until the QPs of the PD have executed the WQEs posted before
    /// the call; `unobservable`: also report (at once) the QPs whose progress the device does
    /// not show (mlx5).
    fn wait_for(&self, timeout: Duration, unobservable: bool) -> Result<(), InFlight> {
        let start = Instant::now();
        let mut watch = SqWatch::new(&self.pd.qps, unobservable);
        let mut pause = Duration::from_micros(1);
        loop {
            watch.poll();
            if watch.pending.is_empty() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout || watch.pending.iter().all(|p| p.blocks.is_none()) {
                return Err(InFlight {
                    lkey: self.lkey,
                    waited,
                    qps: watch.report(),
                });
            }
            std::thread::sleep(pause.min(timeout - waited));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Marks the region as already waited for (its drop logs nothing).
    pub(crate) fn set_quiet(&mut self) {
        self.quiet = true;
    }
}

/// [`Mr::deregister`] ran out of time: the region, not deregistered, and what was in flight.
#[derive(Debug, thiserror::Error)]
#[error("{report}")]
pub struct DeregisterError {
    mr: Box<Mr>,
    report: InFlight,
}

impl DeregisterError {
    /// What was still in flight.
    pub fn report(&self) -> &InFlight {
        &self.report
    }
    /// The region, still registered (drop it to deregister anyway, or try again).
    pub fn into_mr(self) -> Mr {
        *self.mr
    }
    /// Both.
    pub fn into_parts(self) -> (Mr, InFlight) {
        (*self.mr, self.report)
    }
}

impl From<DeregisterError> for Error {
    /// The report; the region is dropped (deregistered at once).
    fn from(e: DeregisterError) -> Self {
        let (mut mr, report) = e.into_parts();
        mr.quiet = true;
        drop(mr);
        Error::InFlight(report)
    }
}

/// How long dropping a region waits for the WQEs posted before it (on a device that shows its
/// progress) before it deregisters all the same.
const DROP_WAIT: Duration = Duration::from_millis(100);

impl Drop for Mr {
    fn drop(&mut self) {
        if !self.quiet {
            // a bounded wait for the WQEs posted before (where the device shows its progress),
            // then a report of what is still in flight
            if let Err(busy) = self.wait_for(DROP_WAIT, false) {
                let qps: Vec<String> = busy.qps.iter().map(ToString::to_string).collect();
                tracing::warn!(
                    lkey = self.lkey,
                    waited = ?busy.waited,
                    in_flight = %qps.join("; "),
                    "memory region dropped while QPs of its PD still have WQEs in flight: \
                     those that use it complete with error CQEs (Mr::deregister waits longer \
                     and gives the region back)"
                );
            }
        }
        // the registration ends when `_registration` drops, next
    }
}
