//! Completion queues and RC queue pairs: sizes, ring placement, doorbell mode, state
//! transitions, endpoints and connection.

use crate::device::Backend;
use crate::endpoint::Endpoint;
use crate::gpu::Gpu;
use crate::memory::{Access, Pd, PdDev};
use crate::{Context, Error};
use softnic::DmaBuf;
use std::sync::{Arc, Mutex, PoisonError};

pub use softnic::{CqInit, CqMode, Modify, QpState};

/// Where a queue's rings live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RingPlacement {
    /// Host memory, mapped into the GPU when a kernel drives the queue.
    #[default]
    HostMapped,
    /// GPU memory (cudaMalloc'ed), for a QP that only kernels drive: the SQ and RQ rings of a
    /// QP, the CQE ring of a CQ. The doorbell record, the doorbell register (UAR) and the CQ
    /// doorbell record stay in host memory, as on hardware (the UAR is NIC BAR space). Needs
    /// the GPU: [`Context::create_cq_on`], [`Pd::create_qp_on`]. The CPU initiator cannot
    /// drive such a queue ([`Qp::try_cpu_initiator`]).
    Gpu,
}

/// How kernels tell the device about new WQEs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DoorbellMode {
    /// The best the platform allows (resolved at QP creation, with the reason recorded).
    #[default]
    Auto,
    /// The kernel writes the doorbell record and an 8-byte doorbell to the mapped register.
    GpuDoorbell,
    /// The kernel copies the whole WQE into the BlueFlame register.
    BlueFlame,
    /// The kernel publishes its producer index in host memory; a host thread rings for it.
    CpuProxy,
}

impl DoorbellMode {
    /// The number the exported descriptor carries (`GPUVERBS_DB_*` in the device API).
    pub fn code(self) -> u32 {
        match self {
            Self::Auto | Self::GpuDoorbell => 0,
            Self::BlueFlame => 1,
            Self::CpuProxy => 2,
        }
    }
}

/// Parameters of a CQ.
#[derive(Clone, Copy, Debug)]
pub struct CqOptions {
    /// Entries (power of two).
    pub depth: u32,
    /// Ring placement.
    pub placement: RingPlacement,
    /// Consumer-index mode. The default, [`CqMode::OverrunDetect`], never loses a completion
    /// silently: the device reads the consumer index from the CQ doorbell record (the CPU
    /// initiator and the device API keep it current), and a CQE that would overwrite one not
    /// yet taken puts the CQ in error and the QP that produced it in ERR; the CPU initiator's
    /// `wait_send` / `wait_recv` then return `InitiatorError::CqOverrun` once the CQEs in the
    /// ring are taken. [`CqMode::OverrunIgnore`] (the device never reads the consumer index;
    /// a slow consumer is overwritten) is for GPU stacks that ask for it.
    pub mode: CqMode,
    /// Initial fill.
    pub init: CqInit,
}

impl Default for CqOptions {
    fn default() -> Self {
        Self {
            depth: 256,
            placement: RingPlacement::HostMapped,
            mode: CqMode::OverrunDetect,
            init: CqInit::Invalid,
        }
    }
}

/// A completion queue.
#[derive(Clone, Debug)]
pub struct Cq {
    pub(crate) ctx: Context,
    pub(crate) dev: CqDev,
}

/// The device's CQ.
#[derive(Clone)]
pub(crate) enum CqDev {
    Soft(Arc<softnic::Cq>),
    Mlx5(Arc<crate::mlx5::Cq>),
}

impl std::fmt::Debug for CqDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Soft(c) => write!(f, "soft CQ {:#x}", c.cqn()),
            Self::Mlx5(c) => write!(f, "mlx5 CQ {:#x}", c.cqn),
        }
    }
}

impl Cq {
    /// The context that owns it.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
    /// Number of entries.
    pub fn depth(&self) -> u32 {
        match &self.dev {
            CqDev::Soft(c) => c.ncqe(),
            CqDev::Mlx5(c) => c.ncqe,
        }
    }
    /// CQ number.
    pub fn cqn(&self) -> u32 {
        match &self.dev {
            CqDev::Soft(c) => c.cqn(),
            CqDev::Mlx5(c) => c.cqn,
        }
    }
    /// The soft NIC's CQ (rings, doorbell record, overrun state): soft backend only.
    pub fn soft(&self) -> Option<&Arc<softnic::Cq>> {
        match &self.dev {
            CqDev::Soft(c) => Some(c),
            CqDev::Mlx5(_) => None,
        }
    }
    /// Where its CQE ring lives.
    pub fn placement(&self) -> RingPlacement {
        match &self.dev {
            CqDev::Soft(c) => placement_of(c.ring()),
            CqDev::Mlx5(_) => RingPlacement::HostMapped,
        }
    }
    /// Where the CQ lives, for a CPU poller.
    pub(crate) fn geometry(&self) -> softnic::initiator::CqGeometry {
        match &self.dev {
            CqDev::Soft(c) => softnic::initiator::CqGeometry {
                ring: c.ring().as_ptr(),
                ncqe: c.ncqe(),
                dbrec: c.dbrec().as_ptr(),
                collapsed: c.mode() == CqMode::Collapsed,
            },
            CqDev::Mlx5(c) => softnic::initiator::CqGeometry {
                ring: c.ring,
                ncqe: c.ncqe,
                dbrec: c.dbrec,
                collapsed: false,
            },
        }
    }
}

fn placement_of(ring: &DmaBuf) -> RingPlacement {
    if ring.is_host() {
        RingPlacement::HostMapped
    } else {
        RingPlacement::Gpu
    }
}

/// `create_cq` / `create_qp` have no GPU to put rings in.
fn needs_gpu(p: RingPlacement, what: &str) -> Result<(), Error> {
    match p {
        RingPlacement::HostMapped => Ok(()),
        RingPlacement::Gpu => Err(Error::Unsupported(format!(
            "rings in GPU memory need the GPU: use {what}(&gpu, options)"
        ))),
    }
}

impl Context {
    /// Creates a completion queue with its ring in host memory
    /// ([`RingPlacement::Gpu`] needs [`Context::create_cq_on`]).
    pub fn create_cq(&self, o: CqOptions) -> Result<Cq, Error> {
        needs_gpu(o.placement, "Context::create_cq_on")?;
        self.create_cq_with(o, None)
    }

    /// Creates a completion queue whose ring is placed as `o.placement` says: in `gpu`'s
    /// memory for [`RingPlacement::Gpu`] (its CQ doorbell record stays in host memory).
    pub fn create_cq_on(&self, gpu: &Arc<Gpu>, o: CqOptions) -> Result<Cq, Error> {
        let ring = match o.placement {
            RingPlacement::HostMapped => None,
            RingPlacement::Gpu => {
                let bytes = (o.depth as usize).saturating_mul(prm::CQE_SIZE);
                Some(gpu.ring_buffer(bytes)?)
            }
        };
        self.create_cq_with(o, ring)
    }

    fn create_cq_with(&self, o: CqOptions, ring: Option<DmaBuf>) -> Result<Cq, Error> {
        if !o.depth.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "CQ depth {} is not a power of two",
                o.depth
            )));
        }
        let dev = match &self.inner.backend {
            Backend::Soft(d) => CqDev::Soft(d.create_cq(softnic::CqConfig {
                ncqe: o.depth,
                mode: o.mode,
                init: o.init,
                ring,
                dbrec: None,
            })?),
            Backend::Mlx5(d) => {
                if ring.is_some() {
                    return Err(Error::Unsupported(
                        "CQ rings in GPU memory on the mlx5 backend need DEVX (not yet)".into(),
                    ));
                }
                if o.mode != CqMode::OverrunDetect || o.init != CqInit::Invalid {
                    return Err(Error::Unsupported(format!(
                        "{:?} / {:?} CQs: rdma-core's mlx5 CQs always detect overrun and start \
                         with op_own 0xF0 (the other modes need DEVX, not yet)",
                        o.mode, o.init
                    )));
                }
                let cq = d.create_cq(o.depth)?;
                if cq.ncqe != o.depth {
                    return Err(Error::Unsupported(format!(
                        "the provider made a CQ of {} entries for {}",
                        cq.ncqe, o.depth
                    )));
                }
                CqDev::Mlx5(cq)
            }
        };
        Ok(Cq {
            ctx: self.clone(),
            dev,
        })
    }
}

/// Parameters of an RC QP.
#[derive(Clone, Debug)]
pub struct QpOptions {
    /// CQ of requester completions.
    pub send_cq: Cq,
    /// CQ of responder completions.
    pub recv_cq: Cq,
    /// SQ size in 64-byte blocks (power of two).
    pub sq_blocks: u32,
    /// RQ size in WQEs (power of two, or 0).
    pub rq_wqes: u32,
    /// SGEs per receive WQE.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline: u32,
    /// Ring placement.
    pub placement: RingPlacement,
    /// Doorbell mode.
    pub doorbell: DoorbellMode,
}

impl QpOptions {
    /// Defaults: 256-block SQ, 256-entry RQ of 1 SGE, 256 bytes inline, host-mapped rings,
    /// automatic doorbell mode.
    pub fn new(send_cq: &Cq, recv_cq: &Cq) -> Self {
        Self {
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            sq_blocks: 256,
            rq_wqes: 256,
            max_recv_sge: 1,
            max_inline: 256,
            placement: RingPlacement::HostMapped,
            doorbell: DoorbellMode::Auto,
        }
    }
}

/// How a QP connects to its peer.
#[derive(Clone, Copy, Debug)]
pub struct ConnectOptions {
    /// Rights peers get through this QP (REMOTE_WRITE/READ/ATOMIC); none by default.
    pub access: Access,
    /// Local ACK timeout exponent (4.096 µs · 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            access: Access::NONE,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
        }
    }
}

/// An RC queue pair. Dropping it destroys the device QP (peers see it vanish).
#[derive(Debug)]
pub struct Qp {
    pub(crate) pd: Pd,
    pub(crate) dev: QpDev,
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) doorbell: DoorbellMode,
    pub(crate) doorbell_reason: String,
    pub(crate) psn: u32,
    pub(crate) posters: Arc<Posters>,
    /// The CPU-proxy word of an mlx5 QP (a soft QP has one in its control page): the kernel
    /// stores its producer index there and the proxy turns it into doorbells.
    pub(crate) proxy_word: Option<crate::HostBuffer>,
}

/// The device's QP.
pub(crate) enum QpDev {
    Soft(Arc<softnic::Qp>),
    Mlx5(Arc<crate::mlx5::Qp>),
}

impl std::fmt::Debug for QpDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Soft(q) => write!(f, "soft QP {:#x}", q.qpn()),
            Self::Mlx5(q) => write!(f, "mlx5 QP {:#x}", q.qpn),
        }
    }
}

/// Who posts to a QP's send queue. A send queue has one poster at a time: a CPU initiator
/// ([`Qp::cpu_initiator`]), a GPU export ([`crate::gpu::Gpu::export_qp`]) or the CPU proxy
/// ([`crate::proxy::ProxyTarget::for_qp`]); a GPU export and the proxy that rings for it may
/// hold the QP together (the CPU-proxy doorbell mode). A new poster continues from the queue's
/// state: producer index, SQ space in flight, CQ consumer indexes and owner parity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poster {
    /// A CPU initiator.
    CpuInitiator,
    /// A descriptor exported to a GPU.
    GpuExport,
    /// A CPU-proxy target.
    Proxy,
}

impl std::fmt::Display for Poster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::CpuInitiator => "a CPU initiator",
            Self::GpuExport => "a GPU export",
            Self::Proxy => "a CPU-proxy target",
        })
    }
}

/// The posters that hold a QP now.
#[derive(Debug, Default)]
pub(crate) struct Posters(Mutex<Vec<Poster>>);

impl Posters {
    /// Takes the QP for `who`, or says who holds it.
    pub(crate) fn claim(self: &Arc<Self>, who: Poster) -> Result<PosterClaim, Error> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let together = |a: Poster, b: Poster| {
            matches!(
                (a, b),
                (Poster::GpuExport, Poster::Proxy) | (Poster::Proxy, Poster::GpuExport)
            )
        };
        if let Some(&h) = held.iter().find(|&&h| !together(h, who)) {
            return Err(Error::PosterBusy {
                held: h,
                wanted: who,
            });
        }
        held.push(who);
        drop(held);
        Ok(PosterClaim {
            posters: self.clone(),
            who,
        })
    }
}

impl Posters {
    /// Whether `who` holds the QP now.
    pub(crate) fn holds(&self, who: Poster) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&who)
    }
}

/// A poster's hold on a QP; dropping it lets the next poster in.
#[derive(Debug)]
pub(crate) struct PosterClaim {
    posters: Arc<Posters>,
    who: Poster,
}

impl Drop for PosterClaim {
    fn drop(&mut self) {
        let mut held = self
            .posters
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = held.iter().position(|&h| h == self.who) {
            held.swap_remove(i);
        }
    }
}

/// A QP's queue state as memory and the device hold it, from which a new poster continues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct QueueState {
    /// The producer index (64-bit): the CPU-proxy word when it is at or ahead of the doorbell
    /// record's 16 bits (a kernel's producer not yet rung, or rung), else those 16 bits.
    pub sq_pi: u64,
    /// Blocks before `sq_pi` that the device has not executed yet.
    pub sq_in_flight: u16,
    /// The RQ head (doorbell record, receive word).
    pub rq_head: u16,
    /// The RQ consumer index (receives consumed), `None` where it cannot be known (an
    /// rdma-core QP whose receive CQ is its send CQ).
    pub rq_consumer: Option<u32>,
    /// Send and receive CQ consumer indexes (their CQ doorbell records, 24 bits).
    pub scq_ci: u32,
    pub rcq_ci: u32,
    /// The last word (wqe_counter, signature, op_own) of the send CQ's slot 0 when it holds
    /// a CQE (for a collapsed CQ).
    pub scq_slot0: Option<u32>,
}

impl QueueState {
    pub(crate) fn of(qp: &softnic::Qp) -> Self {
        use std::sync::atomic::Ordering::Acquire;
        let rec = qp.ctrl_page();
        let word = |i: usize| u32::from_be(rec.atomic_u32(qp.dbrec_offset() + 4 * i).load(Acquire));
        let sq_pi = sq_producer(qp);
        let in_flight = (sq_pi as u16).wrapping_sub(qp.sq_consumer());
        let cq_ci =
            |cq: &softnic::Cq| u32::from_be(cq.dbrec().atomic_u32(0).load(Acquire)) & 0xff_ffff;
        let scq = qp.send_cq();
        let scq_slot0 = scq
            .ring()
            .load_u32_acquire(prm::cqe::CQE_TAIL_OFFSET)
            .ok()
            .filter(|t| t.to_ne_bytes()[3] >> 4 != prm::cqe::CqeOpcode::Invalid as u8);
        Self {
            sq_pi,
            sq_in_flight: if u32::from(in_flight) <= qp.sq_blocks() {
                in_flight
            } else {
                0
            },
            rq_head: word(0) as u16,
            rq_consumer: Some(qp.rq_consumer()),
            scq_ci: cq_ci(scq),
            rcq_ci: cq_ci(qp.recv_cq()),
            scq_slot0,
        }
    }
}

impl QueueState {
    /// The queue state of an rdma-core QP, from the provider's memory alone (the device's
    /// consumer indexes cannot be seen without DEVX): the producer as for a soft QP (doorbell
    /// record and CPU-proxy word), the CQ consumer indexes from their doorbell records, and the
    /// SQ blocks not yet retired counted from the last requester completion the send CQ holds
    /// for this QP (RC completes in order: every WQE up to the end of that one is done; the
    /// blocks after it stay taken until a later completion retires them). Receives: every
    /// consumed receive's completion is taken (what [`crate::gpu`]'s export requires), so the
    /// RQ's consumer index is the receive CQ's.
    pub(crate) fn of_mlx5(qp: &Qp, q: &crate::mlx5::Qp) -> Self {
        use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Acquire};
        // SAFETY: the provider's doorbell record (two aligned 32-bit words) and the proxy word
        // live as long as the QP; the device and pollers access them atomically.
        let word = |i: usize| {
            u32::from_be(unsafe { &*(q.dbrec.add(4 * i) as *const AtomicU32) }.load(Acquire))
        };
        let proxy = qp
            .proxy_word
            .as_ref()
            // SAFETY: the proxy word is 8 aligned bytes of the QP's own host buffer.
            .map_or(0, |w| {
                unsafe { &*(w.addr() as *const AtomicU64) }.load(Acquire)
            });
        let sq_pi = producer_from(word(1) as u16, proxy);
        let cq_ci = |cq: &Cq| match &cq.dev {
            // SAFETY: the provider's CQ doorbell record, live with the CQ.
            CqDev::Mlx5(c) => {
                u32::from_be(unsafe { &*(c.dbrec as *const AtomicU32) }.load(Acquire)) & 0xff_ffff
            }
            CqDev::Soft(_) => 0,
        };
        let (scq_ci, rcq_ci) = (cq_ci(&qp.send_cq), cq_ci(&qp.recv_cq));
        let done_to = match &qp.send_cq.dev {
            CqDev::Mlx5(c) => last_req_end(c, q, scq_ci),
            CqDev::Soft(_) => None,
        };
        let unretired = match done_to {
            Some(end) => (sq_pi as u16).wrapping_sub(end),
            // no completion seen: all of the SQ that was posted may be in flight
            None => (sq_pi.min(u64::from(q.sq_blocks))) as u16,
        };
        Self {
            sq_pi,
            sq_in_flight: if u32::from(unretired) <= q.sq_blocks {
                unretired
            } else {
                0
            },
            rq_head: word(0) as u16,
            // the receive CQ's CQEs are the receives' only when it is not the send CQ too
            rq_consumer: match (&qp.send_cq.dev, &qp.recv_cq.dev) {
                (CqDev::Mlx5(s), CqDev::Mlx5(r)) if Arc::ptr_eq(s, r) => None,
                _ => Some(rcq_ci),
            },
            scq_ci,
            rcq_ci,
            scq_slot0: None,
        }
    }
}

/// The SQ index just past the WQE of the newest requester completion of QP `q` among the
/// CQEs taken from `cq` so far (its consumer index `ci`), looking back at most one ring.
fn last_req_end(cq: &crate::mlx5::Cq, q: &crate::mlx5::Qp, ci: u32) -> Option<u16> {
    let mask = cq.ncqe as usize - 1;
    for k in 1..=cq.ncqe.min(ci) {
        let n = ci - k;
        let mut b = [0u8; prm::CQE_SIZE];
        // SAFETY: slot `n & mask` is inside the provider's CQ ring; CQEs before the consumer
        // index are no longer written by the device (until it wraps, which the owner check
        // below tells).
        unsafe {
            std::ptr::copy_nonoverlapping(
                cq.ring.add((n as usize & mask) * prm::CQE_SIZE),
                b.as_mut_ptr(),
                prm::CQE_SIZE,
            )
        };
        let cqe: prm::Cqe64 = bytemuck::cast(b);
        if u32::from(cqe.op_own & 1) != (n / cq.ncqe) & 1 {
            return None;
        }
        let counter = match cqe.decode() {
            prm::Completion::Req {
                qpn, wqe_counter, ..
            } if qpn == q.qpn => wqe_counter,
            prm::Completion::Error(e) if !e.responder && e.qpn == q.qpn => e.wqe_counter,
            _ => continue,
        };
        let slot = counter as usize & (q.sq_blocks as usize - 1);
        // SAFETY: the WQE's first block is inside the provider's SQ ring; its control
        // segment's ds says how many blocks the WQE took.
        let ctrl: prm::wqe::CtrlSeg = unsafe {
            std::ptr::read_unaligned(q.sq_buf.add(slot * prm::WQEBB) as *const prm::wqe::CtrlSeg)
        };
        let blocks = prm::wqe::blocks_for_ds(ctrl.ds().max(1)) as u16;
        return Some(counter.wrapping_add(blocks));
    }
    None
}

/// A soft QP's send producer index (64-bit): the CPU-proxy word when a kernel wrote it ahead
/// of the doorbell record's 16 bits (its WQEs not rung yet, the proxy will), else those 16
/// bits, as the 64-bit value at or below the word.
pub(crate) fn sq_producer(qp: &softnic::Qp) -> u64 {
    use std::sync::atomic::Ordering::Acquire;
    let rec = qp.ctrl_page();
    let sq16 = u32::from_be(rec.atomic_u32(qp.dbrec_offset() + 4).load(Acquire)) as u16;
    producer_from(sq16, rec.atomic_u64(qp.proxy_offset()).load(Acquire))
}

/// The 64-bit producer from the doorbell record's 16 bits and the CPU-proxy word.
fn producer_from(sq16: u16, proxy: u64) -> u64 {
    proxy
        .checked_sub(u64::from((proxy as u16).wrapping_sub(sq16)))
        .unwrap_or(u64::from(sq16))
}

impl Pd {
    /// Creates an RC QP in RESET, its rings in host memory ([`RingPlacement::Gpu`] needs
    /// [`Pd::create_qp_on`]).
    pub fn create_qp(&self, o: QpOptions) -> Result<Qp, Error> {
        needs_gpu(o.placement, "Pd::create_qp_on")?;
        self.create_qp_with(o, None)
    }

    /// Creates an RC QP in RESET whose SQ and RQ rings are placed as `o.placement` says: in
    /// `gpu`'s memory for [`RingPlacement::Gpu`] (the doorbell record, the CPU-proxy word and
    /// the doorbell register stay in host memory). Its CQs are placed by their own options.
    pub fn create_qp_on(&self, gpu: &Arc<Gpu>, o: QpOptions) -> Result<Qp, Error> {
        let rings = match o.placement {
            RingPlacement::HostMapped => None,
            RingPlacement::Gpu => {
                let sq = (o.sq_blocks as usize).saturating_mul(prm::WQEBB);
                let stride = (o.max_recv_sge.clamp(1, 32) * 16).next_power_of_two() as usize;
                let rq = (o.rq_wqes as usize).saturating_mul(stride);
                Some((gpu.ring_buffer(sq)?, gpu.ring_buffer(rq)?))
            }
        };
        self.create_qp_with(o, rings)
    }

    fn create_qp_with(&self, o: QpOptions, rings: Option<(DmaBuf, DmaBuf)>) -> Result<Qp, Error> {
        let (sq_ring, rq_ring) = rings.unzip();
        let (mode, reason) = match o.doorbell {
            DoorbellMode::Auto => (
                DoorbellMode::GpuDoorbell,
                match &self.dev {
                    PdDev::Soft(_) => {
                        "auto: the soft NIC's doorbell page is host memory that maps into any GPU"
                    }
                    PdDev::Mlx5(_) => {
                        "auto: GPU doorbell; the UAR page is registered into the GPU at export \
                         (as I/O memory, else as plain memory; the export fails and says why \
                         when the GPU cannot map it)"
                    }
                }
                .to_string(),
            ),
            m => (m, "requested".to_string()),
        };
        let dev = match (
            &self.ctx.inner.backend,
            &self.dev,
            &o.send_cq.dev,
            &o.recv_cq.dev,
        ) {
            (Backend::Soft(d), PdDev::Soft(id), CqDev::Soft(scq), CqDev::Soft(rcq)) => {
                QpDev::Soft(d.create_qp(softnic::QpConfig {
                    pd: *id,
                    send_cq: scq.clone(),
                    recv_cq: rcq.clone(),
                    sq_blocks: o.sq_blocks,
                    rq_wqes: o.rq_wqes,
                    max_recv_sge: o.max_recv_sge,
                    max_inline: o.max_inline,
                    doorbell: if mode == DoorbellMode::BlueFlame {
                        softnic::DoorbellKind::BlueFlame
                    } else {
                        softnic::DoorbellKind::Register
                    },
                    sq_ring,
                    rq_ring,
                    rq_stride: None,
                    dbrec: None,
                    uar: None,
                    user_index: None,
                })?)
            }
            (Backend::Mlx5(_), PdDev::Mlx5(pd), CqDev::Mlx5(scq), CqDev::Mlx5(rcq)) => {
                if sq_ring.is_some() {
                    return Err(Error::Unsupported(
                        "QP rings in GPU memory on the mlx5 backend need DEVX (not yet)".into(),
                    ));
                }
                if !o.sq_blocks.is_power_of_two()
                    || (o.rq_wqes != 0 && !o.rq_wqes.is_power_of_two())
                {
                    return Err(Error::InvalidArgument(format!(
                        "SQ of {} blocks, RQ of {} WQEs: powers of two",
                        o.sq_blocks, o.rq_wqes
                    )));
                }
                // libmlx5 sizes the SQ as the power of two of max_send_wr times its largest
                // WQE (ctrl + raddr + the inline data, in 64-byte blocks; versions differ in
                // what else they count): ask for as many work requests of that size as fit in
                // the blocks asked for, and fewer while the provider makes a larger SQ.
                let wqe_blocks = (32 + (4 + o.max_inline as usize).next_multiple_of(16))
                    .div_ceil(prm::WQEBB)
                    .max(1) as u32;
                let mut wrs = (o.sq_blocks / wqe_blocks).max(1);
                loop {
                    let q = pd.create_qp(scq, rcq, wrs, o.rq_wqes, o.max_recv_sge, o.max_inline)?;
                    if q.sq_blocks <= o.sq_blocks || wrs == 1 {
                        break QpDev::Mlx5(q);
                    }
                    wrs /= 2;
                }
            }
            _ => {
                return Err(Error::InvalidArgument(
                    "the QP's CQs belong to another device".into(),
                ))
            }
        };
        tracing::debug!(qpn = dev_qpn(&dev), ?mode, %reason, "QP created");
        self.qps.add(match &dev {
            QpDev::Soft(q) => crate::memory::TrackedQp::Soft(Arc::downgrade(q)),
            QpDev::Mlx5(q) => crate::memory::TrackedQp::Mlx5(Arc::downgrade(q)),
        });
        let dev_kind = match &dev {
            QpDev::Soft(_) => DevKind::Soft,
            QpDev::Mlx5(_) => DevKind::Mlx5,
        };
        // Random per QP (as perftest draws one), so that a QP restarted with the same QPN
        // does not take stale packets of its earlier incarnation, nor do guessed PSNs work.
        let psn = Endpoint::random_psn();
        Ok(Qp {
            pd: self.clone(),
            dev,
            send_cq: o.send_cq,
            recv_cq: o.recv_cq,
            doorbell: mode,
            doorbell_reason: reason,
            psn,
            posters: Arc::default(),
            proxy_word: matches!(dev_kind, DevKind::Mlx5).then(|| crate::HostBuffer::new(64)),
        })
    }
}

enum DevKind {
    Soft,
    Mlx5,
}

fn dev_qpn(d: &QpDev) -> u32 {
    match d {
        QpDev::Soft(q) => q.qpn(),
        QpDev::Mlx5(q) => q.qpn,
    }
}

impl Qp {
    /// QP number.
    pub fn qpn(&self) -> u32 {
        dev_qpn(&self.dev)
    }
    /// State (on the mlx5 backend as QUERY_QP reports it; ERR when the query fails).
    pub fn state(&self) -> QpState {
        match &self.dev {
            QpDev::Soft(q) => q.state(),
            QpDev::Mlx5(q) => match q.state() {
                Ok(0) => QpState::Reset,
                Ok(1) => QpState::Init,
                Ok(2) => QpState::Rtr,
                Ok(3) => QpState::Rts,
                _ => QpState::Err,
            },
        }
    }
    /// The doorbell mode, as resolved, and why.
    pub fn doorbell(&self) -> (DoorbellMode, &str) {
        (self.doorbell, &self.doorbell_reason)
    }
    /// The protection domain.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }
    /// The send CQ.
    pub fn send_cq(&self) -> &Cq {
        &self.send_cq
    }
    /// The receive CQ.
    pub fn recv_cq(&self) -> &Cq {
        &self.recv_cq
    }
    /// The soft NIC's QP (rings, doorbell record, register page, fault injection): soft
    /// backend only.
    pub fn soft(&self) -> Option<&Arc<softnic::Qp>> {
        match &self.dev {
            QpDev::Soft(q) => Some(q),
            QpDev::Mlx5(_) => None,
        }
    }

    /// What the peer needs to connect to this QP (no rkey: memory travels separately, and
    /// only when the application exports it).
    pub fn endpoint(&self) -> Endpoint {
        let sel = self.pd.ctx.selection();
        Endpoint::new(
            self.pd.ctx.gid(),
            self.qpn(),
            self.psn,
            self.pd.ctx.mtu(),
            sel.name.clone(),
        )
        .and_then(|e| e.with_udp_port(self.pd.ctx.udp_port()))
        .expect("a device's own QPN, PSN, MTU and UDP port are in range")
        // a soft NIC on the wire holds packets behind a gap and resends selectively
        .with_selective_repeat(self.pd.ctx.udp_port().is_some())
    }

    /// RESET → INIT → RTR → RTS towards `remote`, at the smaller of both MTUs.
    pub fn connect(&self, remote: &Endpoint, o: ConnectOptions) -> Result<(), Error> {
        use softnic::Modify;
        let mtu = remote.common_mtu(&self.endpoint());
        match &self.dev {
            QpDev::Soft(q) => {
                self.pd.ctx.route_to(q, remote)?;
                q.modify(Modify::Init { access: o.access })?;
                let mut rtr = remote.rtr_attr(o.min_rnr_timer);
                rtr.mtu = mtu;
                rtr.selective_repeat =
                    remote.selective_repeat() && self.endpoint().selective_repeat();
                q.modify(Modify::Rtr(rtr))?;
                q.modify(Modify::Rts(softnic::RtsAttr {
                    sq_psn: self.psn,
                    timeout: o.timeout,
                    retry_cnt: o.retry_cnt,
                    rnr_retry: o.rnr_retry,
                }))?;
            }
            QpDev::Mlx5(q) => {
                let r = crate::mlx5::Remote {
                    gid: remote.gid().0,
                    qpn: remote.qpn(),
                    psn: remote.psn(),
                    mtu,
                };
                q.connect(o.access, &r, self.psn, &o)?;
            }
        }
        Ok(())
    }

    /// A raw state transition (illegal ones are errors). On the mlx5 backend only RESET and
    /// ERR (the others take attributes: [`Qp::connect`]).
    pub fn modify(&self, m: softnic::Modify) -> Result<(), Error> {
        match &self.dev {
            QpDev::Soft(q) => Ok(q.modify(m)?),
            QpDev::Mlx5(q) => match m {
                softnic::Modify::Reset => q.to_state(rdma_core_sys::IBV_QPS_RESET),
                softnic::Modify::Err => q.to_state(rdma_core_sys::IBV_QPS_ERR),
                other => Err(Error::Unsupported(format!(
                    "{other:?} on an mlx5 QP: use Qp::connect"
                ))),
            },
        }
    }

    /// Where its SQ and RQ rings live.
    pub fn placement(&self) -> RingPlacement {
        match &self.dev {
            QpDev::Soft(q) => placement_of(q.sq_ring()),
            QpDev::Mlx5(_) => RingPlacement::HostMapped,
        }
    }

    /// A CPU initiator on this QP (it takes the QP's CQs for itself). It is the QP's one
    /// poster until it is dropped, and it continues from the queue's state ([`Poster`]).
    ///
    /// # Panics
    /// When [`Qp::try_cpu_initiator`] fails: the QP or one of its CQs has its rings in GPU
    /// memory, or the QP already has a poster.
    pub fn cpu_initiator(
        &self,
        mode: softnic::initiator::RingMode,
    ) -> softnic::initiator::Initiator {
        match self.try_cpu_initiator(mode) {
            Ok(i) => i,
            Err(e) => panic!("Qp::cpu_initiator: {e}"),
        }
    }

    /// A CPU initiator on this QP, or an error: [`Error::PosterBusy`] while another poster
    /// (CPU initiator, GPU export, CPU proxy) holds the QP; `Error::Soft(InvalidArgument)`
    /// when the QP or one of its CQs has its rings in GPU memory ([`RingPlacement::Gpu`]):
    /// the CPU writes WQEs and polls CQEs with host stores and loads, which GPU memory does
    /// not take (drive such a QP from a kernel). The initiator holds the QP until it is
    /// dropped; it starts where the queue is: the producer index last rung, the SQ space the
    /// device has not executed yet, the CQ consumer indexes (and owner parity) in the CQ
    /// doorbell records.
    pub fn try_cpu_initiator(
        &self,
        mode: softnic::initiator::RingMode,
    ) -> Result<softnic::initiator::Initiator, Error> {
        let claim = self.posters.claim(Poster::CpuInitiator)?;
        match (&self.pd.ctx.inner.backend, &self.dev) {
            (Backend::Soft(d), QpDev::Soft(q)) => {
                Ok(softnic::initiator::Initiator::try_for_soft_qp(d, q, mode)?
                    .with_guard(Box::new(claim)))
            }
            (Backend::Mlx5(_), QpDev::Mlx5(q)) => {
                let st = QueueState::of_mlx5(self, q);
                let rq_consumer = st.rq_consumer.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "QP {:#x}: receives were posted and its receive CQ is its send CQ: a new \
                         poster cannot tell which receives were consumed (use a CQ of its own \
                         for the receives)",
                        q.qpn
                    ))
                });
                let rq_consumer = if st.rq_head == 0 { Ok(0) } else { rq_consumer }?;
                let sq = softnic::initiator::SqGeometry {
                    ring: q.sq_buf,
                    blocks: q.sq_blocks,
                    dbrec: q.dbrec,
                    bf_reg: q.bf_reg,
                    qpn: q.qpn,
                };
                let rq = softnic::initiator::RqGeometry {
                    ring: q.rq_buf,
                    wqes: q.rq_wqes,
                    stride: q.rq_stride,
                    dbrec: q.dbrec,
                };
                let keep: Arc<dyn std::any::Any + Send + Sync> = Arc::new((
                    q.clone(),
                    self.send_cq.dev.clone(),
                    self.recv_cq.dev.clone(),
                ));
                // SAFETY: the geometry is the provider's (mlx5dv_init_obj) for this live QP
                // and its CQs, kept alive by `keep`; the claim makes the initiator the QP's
                // only poster and its CQs' only poller.
                let mut ini = unsafe {
                    softnic::initiator::Initiator::from_geometry(
                        sq,
                        rq,
                        self.send_cq.geometry(),
                        self.recv_cq.geometry(),
                        mode,
                        keep,
                        None,
                    )
                };
                ini.resume_at(softnic::initiator::QueueStart {
                    sq_pi: st.sq_pi as u16,
                    sq_unfinished: st.sq_in_flight,
                    rq_head: st.rq_head,
                    rq_outstanding: st.rq_head.wrapping_sub(rq_consumer as u16),
                });
                Ok(ini.with_guard(Box::new(claim)))
            }
            _ => unreachable!("a QP belongs to its context's backend"),
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // (an rdma-core QP is destroyed when the last holder, maybe an initiator, lets go)
        if let (Backend::Soft(d), QpDev::Soft(q)) = (&self.pd.ctx.inner.backend, &self.dev) {
            d.destroy_qp(q)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceRequest;
    use softnic::initiator::RingMode;
    use softnic::SimDeviceMemory;

    /// Set in the child processes of the test below.
    const PSN_CHILD: &str = "GPUVERBS_TEST_PSN_CHILD";

    #[test]
    fn initial_psns_are_random_not_a_function_of_the_qpn() {
        if std::env::var_os(PSN_CHILD).is_some() {
            // The first QP of a fresh process: the same QPN in every run.
            let ctx = Context::open(DeviceRequest::Soft).unwrap();
            let pd = ctx.alloc_pd();
            let cq = ctx.create_cq(CqOptions::default()).unwrap();
            let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
            let ep = qp.endpoint();
            println!("\nPSN-CHILD {} {}", qp.qpn(), ep.psn());
            return;
        }
        let name = "queue::tests::initial_psns_are_random_not_a_function_of_the_qpn";
        let mut seen = Vec::new();
        for _ in 0..4 {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", name, "--nocapture", "--test-threads=1"])
                .env(PSN_CHILD, "1")
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text
                .lines()
                .find_map(|l| l.split_once("PSN-CHILD ").map(|(_, v)| v.trim()))
                .unwrap_or_else(|| panic!("no PSN line in {text}"));
            let v: Vec<u32> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            assert!(v[1] <= 0xff_ffff);
            seen.push((v[0], v[1]));
        }
        assert!(seen.iter().all(|&(q, _)| q == seen[0].0), "{seen:x?}");
        let mut psns: Vec<u32> = seen.iter().map(|&(_, p)| p).collect();
        psns.sort_unstable();
        psns.dedup();
        // the same QPN every time; four equal 24-bit draws would be a 2^-72 chance
        assert!(psns.len() > 1, "{seen:x?}");
    }

    #[test]
    fn rings_in_device_memory_reach_the_device_and_refuse_the_cpu() {
        let ctx = Context::open(DeviceRequest::Soft).unwrap();
        let pd = ctx.alloc_pd();
        let gpu_o = CqOptions {
            depth: 64,
            placement: RingPlacement::Gpu,
            ..Default::default()
        };
        // without the GPU: an error that names the call to use
        match ctx.create_cq(gpu_o) {
            Err(Error::Unsupported(m)) => assert!(m.contains("create_cq_on"), "{m}"),
            r => panic!("{r:?}"),
        }
        let mem = SimDeviceMemory::new(1 << 20);
        let ring = |off: u64, len: usize| {
            DmaBuf::from_device(mem.base() + off, len, mem.clone(), Box::new(()))
        };
        let cq = ctx.create_cq_with(gpu_o, Some(ring(0, 64 * 64))).unwrap();
        assert_eq!(cq.placement(), RingPlacement::Gpu);
        let host_cq = ctx.create_cq(CqOptions::default()).unwrap();
        assert_eq!(host_cq.placement(), RingPlacement::HostMapped);
        let mut o = QpOptions::new(&host_cq, &host_cq);
        o.placement = RingPlacement::Gpu;
        match pd.create_qp(o.clone()) {
            Err(Error::Unsupported(m)) => assert!(m.contains("create_qp_on"), "{m}"),
            r => panic!("{r:?}"),
        }
        let qp = pd
            .create_qp_with(o, Some((ring(0x10000, 256 * 64), ring(0x20000, 256 * 16))))
            .unwrap();
        assert_eq!(qp.placement(), RingPlacement::Gpu);
        assert!(matches!(
            qp.try_cpu_initiator(RingMode::Doca),
            Err(Error::Soft(softnic::Error::InvalidArgument(_)))
        ));
        // a host QP on a device-memory CQ is refused too
        let q2 = pd.create_qp(QpOptions::new(&cq, &host_cq)).unwrap();
        assert_eq!(q2.placement(), RingPlacement::HostMapped);
        assert!(q2.try_cpu_initiator(RingMode::Doca).is_err());
        let q3 = pd.create_qp(QpOptions::new(&host_cq, &host_cq)).unwrap();
        assert!(q3.try_cpu_initiator(RingMode::Doca).is_ok());
    }

    #[test]
    fn a_gpu_export_claim_excludes_the_cpu_and_pairs_with_the_proxy() {
        let ctx = Context::open(DeviceRequest::Soft).unwrap();
        let cq = ctx.create_cq(CqOptions::default()).unwrap();
        let qp = ctx.alloc_pd().create_qp(QpOptions::new(&cq, &cq)).unwrap();
        let ini = qp.cpu_initiator(RingMode::Doca);
        assert!(matches!(
            qp.posters.claim(Poster::GpuExport),
            Err(Error::PosterBusy {
                held: Poster::CpuInitiator,
                wanted: Poster::GpuExport
            })
        ));
        drop(ini);
        let gpu = qp.posters.claim(Poster::GpuExport).unwrap();
        let proxy = qp.posters.claim(Poster::Proxy).unwrap();
        assert!(matches!(
            qp.posters.claim(Poster::GpuExport),
            Err(Error::PosterBusy {
                held: Poster::GpuExport,
                wanted: Poster::GpuExport
            })
        ));
        assert!(matches!(
            qp.try_cpu_initiator(RingMode::Doca),
            Err(Error::PosterBusy {
                wanted: Poster::CpuInitiator,
                ..
            })
        ));
        drop((gpu, proxy));
        assert!(qp.try_cpu_initiator(RingMode::Doca).is_ok());
    }

    #[test]
    fn a_gpu_descriptor_continues_from_the_queue() {
        use crate::gpu::resume_desc;
        use crate::{Access, ConnectOptions, HostBuffer};
        use prm::wqe::{CtrlFlags, Local, Op};
        let (a, b) = (
            Context::open(DeviceRequest::Soft).unwrap(),
            Context::open(DeviceRequest::Soft).unwrap(),
        );
        let (sa, ra, cb) = (
            a.create_cq(CqOptions::default()).unwrap(),
            a.create_cq(CqOptions::default()).unwrap(),
            b.create_cq(CqOptions::default()).unwrap(),
        );
        let pa = a.alloc_pd();
        let qa = pa.create_qp(QpOptions::new(&sa, &ra)).unwrap();
        let shared = pa.create_qp(QpOptions::new(&sa, &sa)).unwrap();
        let pb = b.alloc_pd();
        let qb = pb.create_qp(QpOptions::new(&cb, &cb)).unwrap();
        let o = ConnectOptions {
            access: Access::REMOTE_WRITE,
            ..Default::default()
        };
        qa.connect(&qb.endpoint(), o).unwrap();
        qb.connect(&qa.endpoint(), o).unwrap();
        let (src, dst) = (HostBuffer::new(64), HostBuffer::new(64));
        let smr = pa.register(&src).unwrap();
        let dmr = pb
            .register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let mut ini = qa.cpu_initiator(RingMode::RdmaCore);
        ini.post_recv(&[smr.sge(0, 8)]).unwrap();
        for i in 0..3 {
            let op = Op::Write {
                remote: dmr.remote(i * 8),
                local: Local::Sges(&[smr.sge(0, 8)]),
                imm: None,
            };
            ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
            ini.wait_send(std::time::Duration::from_secs(5)).unwrap();
        }
        drop(ini);
        let st = QueueState::of(qa.soft().unwrap());
        let mut d = crate::export::QpDesc {
            rq_wqes: 256,
            ..Default::default()
        };
        resume_desc(&mut d, &st).unwrap();
        assert_eq!(
            (
                d.sq_reserved,
                d.sq_ready,
                d.sq_rung,
                d.sq_retired,
                d.sq_signaled_end
            ),
            (3, 3, 3, 3, 3)
        );
        assert_eq!((d.scq_ci, d.rcq_ci, d.rq_posted), (3, 0, 1));
        // A receive CQ that also takes send completions (here qa's): an RQ never posted to
        // starts fresh, one posted to is not in step with it.
        let mut e = crate::export::QpDesc {
            rq_wqes: 256,
            ..Default::default()
        };
        resume_desc(&mut e, &QueueState::of(shared.soft().unwrap())).unwrap();
        assert_eq!((e.scq_ci, e.rcq_ci, e.rq_posted), (3, 3, 3));
        let mut ini = shared.cpu_initiator(RingMode::RdmaCore);
        ini.post_recv(&[smr.sge(0, 8)]).unwrap();
        drop(ini);
        assert!(matches!(
            resume_desc(&mut e, &QueueState::of(shared.soft().unwrap())),
            Err(Error::InvalidArgument(_))
        ));
    }
}
