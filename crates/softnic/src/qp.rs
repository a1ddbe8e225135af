//! Queue pairs (RC; UD: [`crate::Device::create_ud_qp`]; DC initiators and targets:
//! [`crate::Device::create_dci`], [`crate::Device::create_dct`]): the SQ and RQ rings, the
//! doorbell record, the UAR page with its BlueFlame halves, the CPU-proxy producer word, and
//! the RESET → INIT → RTR → RTS → ERR state machine.

use crate::buffer::DmaBuf;
use crate::counters::Counters;
use crate::cq::Cq;
use crate::event::{AsyncEvent, EventHandler, EventSlot};
use crate::mem::{Access, MrTable, PdId};
use crate::outcome::Stall;
use crate::rc_state::{DcConns, ReqWire, RespWire};
use crate::srq::{Srq, Xrcd};
use crate::staged::Staged;
use crate::{Error, Gid};
use parking_lot::{Mutex, MutexGuard};
use prm::doorbell::{BF_HALF_SIZE, BF_OFFSET, DBR_LESS_OFFSET, UAR_PAGE_SIZE};
use prm::Syndrome;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

pub use verbs::qp::{Modify, QpState, RtrAttr, RtsAttr};
pub use verbs::DoorbellMode;

/// Parameters of a new QP.
pub struct QpConfig {
    /// Protection domain.
    pub pd: PdId,
    /// CQ for requester completions.
    pub send_cq: Arc<Cq>,
    /// CQ for responder completions.
    pub recv_cq: Arc<Cq>,
    /// SQ size in 64-byte blocks (power of two, ≤ 32768).
    pub sq_blocks: u32,
    /// RQ size in WQEs (power of two, or 0 for no RQ).
    pub rq_wqes: u32,
    /// Data segments per receive WQE.
    pub max_recv_sge: u32,
    /// Largest inline payload accepted.
    pub max_inline: u32,
    /// How producers ring: only [`DoorbellMode::BlueFlame`] makes the register take whole
    /// WQEs; every other mode rings with 8-byte doorbells. [`DoorbellMode::NoDbr`] puts the
    /// register of a private UAR page (`uar` `None`) at `prm::doorbell::DBR_LESS_OFFSET`.
    /// [`DoorbellMode::NoDbrEmulated`] is an ordinary QP whose private register's doorbells
    /// are taken out once read (see [`Qp::takes_doorbells_out`]).
    pub doorbell: DoorbellMode,
    /// SQ ring memory; allocated in host memory when `None`.
    pub sq_ring: Option<DmaBuf>,
    /// RQ ring memory; allocated in host memory when `None`.
    pub rq_ring: Option<DmaBuf>,
    /// Bytes per receive WQE (a power of two ≥ 16 · `max_recv_sge`); the smallest such power
    /// of two when `None`.
    pub rq_stride: Option<u32>,
    /// Where the 8-byte doorbell record lives (offset 0 of this buffer): memory the writer
    /// allocated, as a verbs provider does. In the QP's own control page when `None`.
    pub dbrec: Option<DmaBuf>,
    /// The doorbell register, when it is on a UAR page several QPs share (a verbs context's
    /// pages). A private UAR page when `None`.
    pub uar: Option<UarRegister>,
    /// A user index (24 bits) written into every CQE of this QP (`srqn_uidx`), as a ConnectX
    /// does for QPs created with one under CQE version 1. `None`: the field stays 0.
    pub user_index: Option<u32>,
    /// Cross-channel master (a ConnectX's `cd_master` in the QP context): the QP may post WAIT
    /// WQEs on any CQ of the device. A WAIT on a QP without it fails (docs/softnic.md, "What
    /// WAIT waits for").
    pub cross_channel: bool,
}

/// A doorbell (BlueFlame) register on a UAR page that may be shared by several QPs: doorbells
/// written to it carry the QPN of the QP they are for, and a QP ignores those naming another.
#[derive(Clone)]
pub struct UarRegister {
    /// The UAR page.
    pub page: Arc<DmaBuf>,
    /// Offset of the register (its first half) in the page: `0x800 + k · bf_reg_size`, or
    /// `prm::doorbell::DBR_LESS_OFFSET` for a QP rung without a send doorbell record.
    pub offset: usize,
    /// How many registers, from `offset` on, the QP's doorbells may arrive at (1 or 2): 2 where
    /// the device cannot know which register of the page the library picked (a dynamically
    /// allocated UAR page holds two, and the doorbell's QPN says whose it is, as on a ConnectX).
    pub registers: usize,
}

/// Most BlueFlame registers one QP watches ([`UarRegister::registers`]).
pub const MAX_REGISTERS: usize = 2;

impl QpConfig {
    /// A config with the given PD and CQs, a 256-block SQ, a 256-entry RQ of 1 SGE, 256 bytes
    /// of inline and register doorbells.
    pub fn new(pd: PdId, send_cq: Arc<Cq>, recv_cq: Arc<Cq>) -> Self {
        Self {
            pd,
            send_cq,
            recv_cq,
            sq_blocks: 256,
            rq_wqes: 256,
            max_recv_sge: 1,
            max_inline: 256,
            doorbell: DoorbellMode::Auto,
            sq_ring: None,
            rq_ring: None,
            rq_stride: None,
            dbrec: None,
            uar: None,
            user_index: None,
            cross_channel: false,
        }
    }
}

/// Parameters of a new DC target ([`crate::Device::create_dct`]).
pub struct DctConfig {
    /// Protection domain of the memory initiators reach.
    pub pd: PdId,
    /// CQ for the target's receive completions.
    pub cq: Arc<Cq>,
    /// Where SENDs take their receive WQEs.
    pub srq: Arc<Srq>,
    /// The DC access key initiators must present.
    pub key: u64,
    /// A user index for the target's CQEs (as [`QpConfig::user_index`]).
    pub user_index: Option<u32>,
}

/// The transport service of a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Reliable connected: one peer QP, set at RTR.
    Rc,
    /// Unreliable connected: one peer QP, set at RTR; SENDs and RDMA WRITEs only, no ACK (a
    /// message completes once it has left; one the responder cannot take is lost).
    Uc,
    /// Unreliable datagram: each send WQE names its destination.
    Ud,
    /// DC initiator: reliable like RC, but each send WQE names its DC target (DCT number, GID,
    /// DC access key) in an address vector; it serves one target at a time and moves to
    /// another between messages.
    Dci,
    /// DC target: a responder only, taking requests from any DC initiator that presents its
    /// access key; its receives come from an SRQ.
    Dct {
        /// The DC access key initiators must present.
        key: u64,
    },
    /// XRC initiator (XRC_INI, `IBV_QPT_XRC_SEND`): connected as RC to an XRC target, send
    /// only; each SEND, RDMA WRITE, READ or atomic names the target's XRC SRQ in its XRC
    /// segment.
    XrcIni,
    /// XRC target (XRC_TGT, `IBV_QPT_XRC_RECV`): connected as RC to an XRC initiator, a
    /// responder only, with no queues of its own; each request's receive comes from the XRC
    /// SRQ of its domain that the request names, and completes on that SRQ's CQ.
    XrcTgt,
}

/// Test-only misbehaviour of a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The next `count` WQEs fail with `syndrome`.
    FailNext {
        /// How many.
        count: u32,
        /// With what.
        syndrome: Syndrome,
    },
    /// Every completion of this QP is written `delay` late.
    DelayCompletions(Duration),
    /// The next `count` doorbells are ignored.
    DropDoorbells(u32),
}

/// Offsets of the QP's own control words in its control page.
pub(crate) const DBREC_OFF: usize = 0;
pub(crate) const PROXY_OFF: usize = 64;

/// Requester-side state, owned by the engine while it runs the SQ.
pub(crate) struct SqState {
    pub ci: u16,
    pub target: u16,
    pub last_half: [u64; 2 * MAX_REGISTERS],
    pub bf: Option<(u16, [u8; BF_HALF_SIZE])>,
    pub remote: Option<(Gid, u32)>,
    /// DC initiator: the access key presented to the target [`SqState::remote`] names.
    pub dc_key: u64,
    pub peer: Option<Weak<Qp>>,
    pub rts: RtsAttr,
    pub stall: Option<Stall>,
    pub rnr_attempts: u32,
    pub retry_deadline: Option<Instant>,
    pub fail_next: Option<(u32, Syndrome)>,
    pub delay: Option<Duration>,
    pub drop_doorbells: u32,
    /// Path MTU (from RTR).
    pub mtu: u32,
    /// Selective repeat agreed at RTR ([`RtrAttr::selective_repeat`]).
    pub selective_repeat: bool,
    /// The requester transport, once the peer was found on the wire.
    pub wire: Option<Box<ReqWire>>,
    /// UD: the PSN of the next datagram sent (from `sq_psn` at RTS).
    pub ud_psn: u32,
    /// DC initiator: how many times it moved to a target (the DCETH's generation).
    pub dc_generation: u32,
    /// XRC initiator: the remote XRC SRQ the WQE being executed names.
    pub xrc_srqn: Option<u32>,
    /// WQE blocks read ahead from a send ring in device memory.
    pub ahead: ReadAhead,
    /// Sources of wire-bound WRITEs and SENDs in device memory, read ahead of their turn.
    pub staged: Staged,
}

/// Blocks `start ..` of a send ring in device memory, read in one copy: every one was announced
/// by the producer when it was read and lies at or past the consumer, so the producer cannot
/// rewrite it before the engine has run it. Emptied whenever the consumer moves other than
/// through it (a BlueFlame copy, a reset), so that a 16-bit index coming round never meets
/// old bytes.
#[derive(Default)]
pub(crate) struct ReadAhead {
    pub start: u16,
    pub bytes: Vec<u8>,
}

impl SqState {
    /// How many blocks from `idx` on [`SqState::ahead`] holds.
    pub fn ahead_blocks(&self, idx: u16) -> usize {
        let off = idx.wrapping_sub(self.ahead.start) as usize;
        (self.ahead.bytes.len() / prm::WQEBB).saturating_sub(off)
    }
}

/// Responder-side state.
pub(crate) struct RqState {
    pub ci: u32,
    /// The SRQ WQE this QP took for the message in progress (QPs on an SRQ).
    pub srq_wqe: Option<u16>,
    /// An XRC target: the XRC SRQ the request in progress named.
    pub xrc_srq: Option<Arc<Srq>>,
    pub access: Access,
    pub min_rnr_timer: u8,
    /// The wire responder's state (expected PSN, MSN, message in progress).
    pub wire: RespWire,
}

/// An RC queue pair.
pub struct Qp {
    pub(crate) qpn: u32,
    pub(crate) pd: PdId,
    pub(crate) mrs: Arc<MrTable>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) send_cq: Arc<Cq>,
    pub(crate) recv_cq: Arc<Cq>,
    pub(crate) sq_blocks: u32,
    pub(crate) rq_wqes: u32,
    pub(crate) rq_stride: u32,
    pub(crate) max_recv_sge: u32,
    pub(crate) max_inline: u32,
    pub(crate) doorbell: DoorbellMode,
    pub(crate) sq_ring: DmaBuf,
    pub(crate) rq_ring: DmaBuf,
    pub(crate) ctrl: DmaBuf,
    /// An external doorbell record ([`QpConfig::dbrec`]); the control page holds it otherwise.
    dbrec_ext: Option<DmaBuf>,
    pub(crate) uar: Arc<DmaBuf>,
    /// Offset of this QP's doorbell register in [`Qp::uar`].
    pub(crate) bf_off: usize,
    /// Whether other QPs ring the same register (doorbells naming them are not errors).
    pub(crate) shared_uar: bool,
    /// Register halves watched from `bf_off` on (2 per register).
    pub(crate) halves: usize,
    /// [`QpConfig::user_index`].
    user_index: Option<u32>,
    /// [`QpConfig::cross_channel`].
    pub(crate) cross_channel: bool,
    /// RC, UD (datagrams to and from any QP; [`crate::ud`]), or a DC initiator or target.
    pub(crate) transport: Transport,
    /// UD: the Q_Key.
    qkey: AtomicU32,
    state: AtomicU8,
    /// Set once by [`Qp::retire`] (the QP was destroyed, or its device closed): every thread
    /// that reaches the QP's rings, doorbell record or CQs does so holding its SQ or RQ lock
    /// and checks this first, so after `retire` returns nothing touches that memory again.
    destroyed: AtomicBool,
    /// The connected peer for the wire: `1 << 56 | ipv4 << 24 | qpn`, 0 when none.
    remote: AtomicU64,
    /// Where the responder's answers go on the wire: `1 << 48 | ipv4 << 16 | udp port`, 0
    /// until the first request decides it ([`Qp::answer_addr`]).
    answer_to: AtomicU64,
    pub(crate) sq: Mutex<SqState>,
    pub(crate) rq: Mutex<RqState>,
    /// The SRQ receives come from (instead of the RQ).
    pub(crate) srq: Option<Arc<Srq>>,
    /// An XRC target's domain: the XRC SRQs its requests may name.
    pub(crate) xrcd: Option<Arc<Xrcd>>,
    /// A DC target's responder state per initiator on the wire. Held while a request to the
    /// target runs (in process too), so that one initiator's state is never another's.
    pub(crate) dc_conns: Mutex<DcConns>,
    /// Whether LAST_WQE_REACHED was raised since the QP last entered ERR.
    pub(crate) last_wqe_raised: AtomicBool,
    /// Selective repeat: the responder holds packets behind a gap (the engine's timer names
    /// the gap again while it stays).
    pub(crate) holding: AtomicBool,
    /// A CPU initiator that wakes the engine after each doorbell posts to this QP (the
    /// engine needs not poll for its doorbells).
    pub(crate) kicking_poster: AtomicBool,
    /// The turn of its engine's loop that last looked at this QP, while a kicking poster is
    /// attached: a poster that sees it stand still knows the engine is not running (it waits
    /// for a core, perhaps the poster's own) and stops spinning.
    pub(crate) engine_turn: AtomicU64,
    pub(crate) events: EventSlot,
}

impl Qp {
    pub(crate) fn new(
        qpn: u32,
        cfg: QpConfig,
        transport: Transport,
        srq: Option<Arc<Srq>>,
        mrs: Arc<MrTable>,
        counters: Arc<Counters>,
    ) -> Result<Self, Error> {
        if srq.as_ref().is_some_and(|s| s.pd() != cfg.pd) {
            return Err(Error::InvalidArgument("the SRQ is in another PD"));
        }
        let pow2 = |n: u32| n.is_power_of_two();
        if !pow2(cfg.sq_blocks) || cfg.sq_blocks > 32768 {
            return Err(Error::InvalidArgument(
                "SQ size must be a power of two ≤ 32768 blocks",
            ));
        }
        if cfg.rq_wqes != 0 && (!pow2(cfg.rq_wqes) || cfg.rq_wqes > 32768) {
            return Err(Error::InvalidArgument(
                "RQ size must be 0 or a power of two ≤ 32768",
            ));
        }
        if cfg.max_recv_sge == 0 || cfg.max_recv_sge > 32 {
            return Err(Error::InvalidArgument("max_recv_sge must be 1..=32"));
        }
        if cfg.max_inline as usize > prm::wqe::MAX_INLINE_SEND {
            return Err(Error::InvalidArgument(
                "max_inline larger than a WQE can carry",
            ));
        }
        let min_stride = (cfg.max_recv_sge * 16).next_power_of_two();
        let rq_stride = match cfg.rq_stride {
            None => min_stride,
            Some(s) if s.is_power_of_two() && s >= min_stride && s <= 1 << 15 => s,
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "RQ stride must be a power of two ≥ 16 · max_recv_sge",
                ))
            }
        };
        if cfg.dbrec.as_ref().is_some_and(|d| d.len() < 8) {
            return Err(Error::InvalidArgument("doorbell record must be 8 bytes"));
        }
        let (uar, bf_off, shared_uar, halves) = match cfg.uar {
            // a private page: its BlueFlame register, or (no-DBR) its DBR-less register
            None => {
                let off = match cfg.doorbell {
                    DoorbellMode::NoDbr => DBR_LESS_OFFSET,
                    _ => BF_OFFSET,
                };
                (Arc::new(DmaBuf::alloc(UAR_PAGE_SIZE)), off, false, 2)
            }
            Some(r) => {
                let halves = 2 * r.registers;
                if !r.page.is_host()
                    || !(1..=MAX_REGISTERS).contains(&r.registers)
                    || (r.offset < BF_OFFSET && r.offset != DBR_LESS_OFFSET)
                    || r.offset % 8 != 0
                    || r.offset + halves * BF_HALF_SIZE > r.page.len()
                {
                    return Err(Error::InvalidArgument(
                        "doorbell register outside its UAR page",
                    ));
                }
                (r.page, r.offset, true, halves)
            }
        };
        let sq_bytes = cfg.sq_blocks as usize * prm::WQEBB;
        let rq_bytes = (cfg.rq_wqes * rq_stride) as usize;
        let ring = |given: Option<DmaBuf>, bytes: usize, what| match given {
            Some(r) if r.len() < bytes => Err(Error::InvalidArgument(what)),
            Some(r) => Ok(r),
            None => Ok(DmaBuf::alloc(bytes)),
        };
        Ok(Self {
            qpn,
            pd: cfg.pd,
            mrs,
            counters,
            sq_ring: ring(cfg.sq_ring, sq_bytes, "SQ ring memory too small")?,
            rq_ring: ring(cfg.rq_ring, rq_bytes, "RQ ring memory too small")?,
            send_cq: cfg.send_cq,
            recv_cq: cfg.recv_cq,
            sq_blocks: cfg.sq_blocks,
            rq_wqes: cfg.rq_wqes,
            rq_stride,
            max_recv_sge: cfg.max_recv_sge,
            max_inline: cfg.max_inline,
            doorbell: cfg.doorbell,
            ctrl: DmaBuf::alloc(128),
            dbrec_ext: cfg.dbrec,
            uar,
            bf_off,
            shared_uar,
            halves,
            user_index: cfg.user_index.map(|u| u & 0xff_ffff),
            cross_channel: cfg.cross_channel,
            transport,
            qkey: AtomicU32::new(0),
            state: AtomicU8::new(QpState::Reset as u8),
            destroyed: AtomicBool::new(false),
            remote: AtomicU64::new(0),
            answer_to: AtomicU64::new(0),
            sq: Mutex::new(SqState {
                ci: 0,
                target: 0,
                last_half: [0; 2 * MAX_REGISTERS],
                bf: None,
                remote: None,
                dc_key: 0,
                peer: None,
                rts: RtsAttr::default(),
                stall: None,
                rnr_attempts: 0,
                retry_deadline: None,
                fail_next: None,
                delay: None,
                drop_doorbells: 0,
                mtu: 4096,
                selective_repeat: false,
                wire: None,
                ud_psn: 0,
                dc_generation: 0,
                xrc_srqn: None,
                ahead: ReadAhead::default(),
                staged: Staged::default(),
            }),
            srq,
            xrcd: None,
            dc_conns: Mutex::default(),
            last_wqe_raised: AtomicBool::new(false),
            holding: AtomicBool::new(false),
            kicking_poster: AtomicBool::new(false),
            engine_turn: AtomicU64::new(0),
            events: EventSlot::default(),
            rq: Mutex::new(RqState {
                ci: 0,
                srq_wqe: None,
                xrc_srq: None,
                access: Access::NONE,
                min_rnr_timer: 0,
                wire: Default::default(),
            }),
        })
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// The transport service.
    pub fn transport(&self) -> Transport {
        self.transport
    }
    /// Whether this is a UD QP.
    pub fn is_ud(&self) -> bool {
        self.transport == Transport::Ud
    }
    /// Whether this is a UC QP.
    pub fn is_uc(&self) -> bool {
        self.transport == Transport::Uc
    }
    /// The class of the packets it sends and takes on the wire.
    pub(crate) fn wire_class(&self) -> crate::net::packet::Class {
        use crate::net::packet::Class;
        match self.transport {
            Transport::Uc => Class::Uc,
            Transport::XrcIni | Transport::XrcTgt => Class::Xrc,
            Transport::Dci | Transport::Dct { .. } => Class::Dc,
            Transport::Rc | Transport::Ud => Class::Rc,
        }
    }
    /// An XRC target's domain (`None` for other QPs).
    pub fn xrcd(&self) -> Option<&Arc<Xrcd>> {
        self.xrcd.as_ref()
    }
    /// Makes a new XRC target's domain known (before it is shared).
    pub(crate) fn with_xrcd(mut self, xrcd: Arc<Xrcd>) -> Self {
        self.xrcd = Some(xrcd);
        self
    }
    /// Whether the QP takes a request packet (`request`) or a response one: an initiator
    /// (DC, XRC) takes no requests, an XRC target no responses.
    pub(crate) fn takes_packet(&self, request: bool) -> bool {
        match self.transport {
            Transport::Dci | Transport::XrcIni => !request,
            Transport::XrcTgt => request,
            _ => true,
        }
    }
    /// Whether this is a DC initiator.
    pub fn is_dci(&self) -> bool {
        self.transport == Transport::Dci
    }
    /// The access key of a DC target (`None` for other QPs).
    pub fn dct_key(&self) -> Option<u64> {
        match self.transport {
            Transport::Dct { key } => Some(key),
            _ => None,
        }
    }
    /// The Q_Key of a UD QP (0 for RC).
    pub fn qkey(&self) -> u32 {
        self.qkey.load(Ordering::Acquire)
    }
    /// Changes the Q_Key of a UD QP (an optional attribute of its later transitions).
    pub fn set_qkey(&self, qkey: u32) -> Result<(), Error> {
        if !self.is_ud() {
            return Err(Error::InvalidArgument("only a UD QP has a Q_Key"));
        }
        self.qkey.store(qkey, Ordering::Release);
        Ok(())
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        QpState::from_u8(self.state.load(Ordering::Acquire))
    }
    pub(crate) fn set_state(&self, s: QpState) {
        self.state.store(s as u8, Ordering::Release);
    }
    /// Moves the QP to ERR for an error no completion of its own reports, raising `e` when
    /// the QP was not already in ERR.
    pub(crate) fn fatal(&self, e: AsyncEvent) {
        let was = self.state.swap(QpState::Err as u8, Ordering::AcqRel);
        if QpState::from_u8(was) != QpState::Err {
            self.events.raise(e);
        }
    }
    /// Sets (or clears) the receiver of this QP's asynchronous events.
    pub fn set_event_handler(&self, h: Option<EventHandler>) {
        self.events.set(h);
    }
    /// The SRQ this QP takes its receives from, if any.
    pub fn srq(&self) -> Option<&Arc<Srq>> {
        self.srq.as_ref()
    }
    /// The connected peer's IPv4 address (from its GID) and QPN, when its GID is
    /// IPv4-mapped and the QP has been through RTR.
    pub(crate) fn wire_remote(&self) -> Option<(std::net::Ipv4Addr, u32)> {
        let v = self.remote.load(Ordering::Acquire);
        (v >> 56 == 1).then(|| {
            (
                std::net::Ipv4Addr::from((v >> 24) as u32),
                (v & 0xff_ffff) as u32,
            )
        })
    }
    /// A DC initiator's current target on the wire (the IPv4 address of its GID and its
    /// DCTN): the only source whose answers it takes. `None`: none on the wire.
    pub(crate) fn set_wire_remote(&self, target: Option<(std::net::Ipv4Addr, u32)>) {
        let v = target.map_or(0, |(ip, qpn)| {
            1u64 << 56 | (u32::from(ip) as u64) << 24 | qpn as u64
        });
        self.remote.store(v, Ordering::Release);
    }
    /// Where the responder's answers go on the wire: the connected peer's address, decided
    /// by `decide` at the first request after RTR (a lookup of the peer table) and kept, as
    /// the requester keeps its route. Never the source of a request.
    pub(crate) fn answer_addr(
        &self,
        decide: impl FnOnce() -> std::net::SocketAddrV4,
    ) -> std::net::SocketAddrV4 {
        let v = self.answer_to.load(Ordering::Acquire);
        if v >> 48 == 1 {
            return std::net::SocketAddrV4::new(
                std::net::Ipv4Addr::from((v >> 16) as u32),
                v as u16,
            );
        }
        let a = decide();
        let v = 1u64 << 48 | (u32::from(*a.ip()) as u64) << 16 | a.port() as u64;
        self.answer_to.store(v, Ordering::Release);
        a
    }
    /// Protection domain.
    pub fn pd(&self) -> PdId {
        self.pd
    }
    /// SQ size in blocks.
    pub fn sq_blocks(&self) -> u32 {
        self.sq_blocks
    }
    /// RQ size in WQEs.
    pub fn rq_wqes(&self) -> u32 {
        self.rq_wqes
    }
    /// Bytes per receive WQE.
    pub fn rq_stride(&self) -> u32 {
        self.rq_stride
    }
    /// Data segments per receive WQE.
    pub fn max_recv_sge(&self) -> u32 {
        self.max_recv_sge
    }
    /// Largest inline payload.
    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }
    /// How producers ring ([`QpConfig::doorbell`]).
    pub fn doorbell_mode(&self) -> DoorbellMode {
        self.doorbell
    }
    /// The send CQ.
    pub fn send_cq(&self) -> &Arc<Cq> {
        &self.send_cq
    }
    /// The receive CQ.
    pub fn recv_cq(&self) -> &Arc<Cq> {
        &self.recv_cq
    }
    /// The SQ ring.
    pub fn sq_ring(&self) -> &DmaBuf {
        &self.sq_ring
    }
    /// The RQ ring.
    pub fn rq_ring(&self) -> &DmaBuf {
        &self.rq_ring
    }
    /// The QP's control page: the CPU-proxy producer word (offset [`Qp::proxy_offset`]) and,
    /// unless the QP was given an external one, the doorbell record.
    pub fn ctrl_page(&self) -> &DmaBuf {
        &self.ctrl
    }
    /// The buffer holding the 8-byte doorbell record, at [`Qp::dbrec_offset`].
    pub fn dbrec_page(&self) -> &DmaBuf {
        self.dbrec_ext.as_ref().unwrap_or(&self.ctrl)
    }
    /// Offset of the 8-byte doorbell record in [`Qp::dbrec_page`].
    pub fn dbrec_offset(&self) -> usize {
        if self.dbrec_ext.is_some() {
            0
        } else {
            DBREC_OFF
        }
    }
    /// Word `i` of the doorbell record (0: RQ head, 1: SQ producer), as a number: a load with
    /// acquire in host memory, a copy in device memory (`None` when that read fails).
    fn dbrec_load(&self, i: usize) -> Option<u32> {
        let w = self
            .dbrec_page()
            .load_u32_acquire(self.dbrec_offset() + 4 * i)
            .ok()?;
        Some(u32::from_be(w))
    }
    /// The SQ producer counter published in a doorbell record in host memory (low 16 bits).
    /// `None` for a record in device memory: a device takes the SQ producer from the doorbell
    /// itself, and reading device memory at every doorbell would cost a copy.
    pub(crate) fn sq_dbrec(&self) -> Option<u16> {
        if !self.dbrec_page().is_host() {
            return None;
        }
        self.dbrec_load(1).map(|w| w as u16)
    }
    /// The SQ producer counter published in the doorbell record wherever it lives (a copy from
    /// device memory; `None` when that read fails): for a doorbell on a shared register that
    /// names another QP, which may have replaced this QP's own.
    pub(crate) fn sq_dbrec_anywhere(&self) -> Option<u16> {
        self.dbrec_load(1).map(|w| w as u16)
    }
    /// The RQ producer counter the application published in its doorbell record (low 16 bits);
    /// a record in device memory that cannot be read shows no new receive.
    pub(crate) fn rq_head(&self, known: u16) -> u16 {
        self.dbrec_load(0).map_or(known, |w| w as u16)
    }
    /// Offset of the 8-byte CPU-proxy producer word in [`Qp::ctrl_page`].
    pub fn proxy_offset(&self) -> usize {
        PROXY_OFF
    }
    /// The UAR page; the doorbell / BlueFlame register halves are at [`Qp::bf_offset`] and
    /// `bf_offset() + BF_HALF_SIZE` ([`prm::doorbell::BF_OFFSET`] on a private page).
    pub fn uar(&self) -> &DmaBuf {
        &self.uar
    }
    /// Offset of the QP's doorbell register in [`Qp::uar`].
    pub fn bf_offset(&self) -> usize {
        self.bf_off
    }
    /// Puts the QP's user index into a CQE written for it.
    pub(crate) fn stamp(&self, mut cqe: prm::cqe::Cqe64) -> prm::cqe::Cqe64 {
        if let Some(u) = self.user_index {
            cqe.srqn_uidx = prm::Be32::new(u);
        }
        cqe
    }

    pub(crate) fn lock_sq(&self) -> MutexGuard<'_, SqState> {
        self.sq.lock()
    }
    pub(crate) fn lock_rq(&self) -> MutexGuard<'_, RqState> {
        self.rq.lock()
    }
    /// The SQ state, locked, unless the QP was destroyed: what every thread that runs the
    /// send queue (its ring, doorbell record, send CQ, the wire requester) takes.
    pub(crate) fn lock_sq_live(&self) -> Option<MutexGuard<'_, SqState>> {
        let sq = self.sq.lock();
        (!self.is_destroyed()).then_some(sq)
    }
    /// The RQ state, locked, unless the QP was destroyed: what every thread that runs the
    /// receive side (its ring, doorbell record, receive CQ, the wire responder) takes.
    pub(crate) fn lock_rq_live(&self) -> Option<MutexGuard<'_, RqState>> {
        let rq = self.rq.lock();
        (!self.is_destroyed()).then_some(rq)
    }
    /// Whether the QP was destroyed (or its device closed).
    pub fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }
    /// Destroys the QP as the device sees it, and fences every thread that may be working on
    /// it: it enters RESET for good, then the SQ and RQ locks are taken once each, so an
    /// engine, wire or peer thread inside either has left it, and every later one sees the
    /// flag and leaves the memory alone. After this returns the QP's rings, doorbell record and
    /// CQ entries may be freed by their owner (a verbs provider does, right after DESTROY_QP).
    pub(crate) fn retire(&self) {
        self.destroyed.store(true, Ordering::Release);
        self.set_state(QpState::Reset);
        drop(self.sq.lock());
        drop(self.rq.lock());
    }

    /// Reads the current value of BF half `h` (its first 8 bytes).
    pub(crate) fn half_word(&self, h: usize) -> u64 {
        self.uar
            .atomic_u64(self.bf_off + h * BF_HALF_SIZE)
            .load(Ordering::Acquire)
    }

    /// Whether the engine takes each doorbell out of the register once it has read it: a
    /// [`DoorbellMode::NoDbrEmulated`] QP on a private register. Its producer rings twice
    /// with one value by design (the kernel, then the host proxy after writing the record,
    /// as GPUNetIO's software-emulated no-DBR mode does): a ConnectX takes each register
    /// write as a doorbell, so the second one reaches it even when it lost the first; this
    /// register is a word of memory, where the same value written again is no change.
    pub(crate) fn takes_doorbells_out(&self) -> bool {
        self.doorbell == DoorbellMode::NoDbrEmulated && !self.shared_uar
    }

    /// Takes doorbell value `v` out of BF half `h` (a compare-exchange to 0: a value written
    /// since stays for the next look). Whether it was still there.
    pub(crate) fn take_half(&self, h: usize, v: u64) -> bool {
        self.uar
            .atomic_u64(self.bf_off + h * BF_HALF_SIZE)
            .compare_exchange(v, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// Applies a state transition.
    pub fn modify(&self, m: Modify) -> Result<(), Error> {
        use QpState::*;
        let from = self.state();
        let to = match m {
            Modify::Init { .. } | Modify::InitUd { .. } => Init,
            Modify::Rtr(_) | Modify::RtrUd | Modify::RtrDc { .. } => Rtr,
            Modify::Rts(_) => Rts,
            Modify::Err => Err,
            Modify::Reset => Reset,
        };
        if !verbs::qp::can_move(from, to) {
            return Result::Err(Error::IllegalTransition { from, to });
        }
        if !self.takes(&m) {
            return Result::Err(Error::InvalidArgument(
                "attributes of another transport (RC, UD or DC), or a DC target past RTR",
            ));
        }
        if m == Modify::Reset {
            // before the SQ and RQ locks: a request to a DC target holds this, then the RQ's
            self.dc_conns.lock().clear();
        }
        let mut sq = self.lock_sq();
        let mut rq = self.lock_rq();
        if self.is_destroyed() {
            return Result::Err(Error::InvalidArgument("the QP was destroyed"));
        }
        match m {
            Modify::Init { access } => rq.access = access,
            Modify::InitUd { qkey } => self.qkey.store(qkey, Ordering::Release),
            Modify::RtrUd => {}
            Modify::RtrDc { mtu, min_rnr_timer } => {
                if !matches!(mtu, 256 | 512 | 1024 | 2048 | 4096) || min_rnr_timer > 31 {
                    return Result::Err(Error::InvalidArgument(
                        "path MTU must be 256..4096, a power of two; RNR timer ≤ 31",
                    ));
                }
                sq.remote = None;
                sq.peer = None;
                sq.mtu = mtu;
                sq.wire = None;
                rq.min_rnr_timer = min_rnr_timer;
            }
            Modify::Rtr(a) => {
                if !matches!(a.mtu, 256 | 512 | 1024 | 2048 | 4096) {
                    return Result::Err(Error::InvalidArgument(
                        "path MTU must be 256..4096, a power of two",
                    ));
                }
                if a.remote_qpn > 0xff_ffff || a.min_rnr_timer > 31 {
                    return Result::Err(Error::InvalidArgument(
                        "remote QPN or RNR timer out of range",
                    ));
                }
                sq.remote = Some((a.remote_gid, a.remote_qpn));
                sq.peer = None;
                sq.mtu = a.mtu;
                sq.selective_repeat = a.selective_repeat;
                sq.wire = None;
                sq.staged.clear();
                rq.min_rnr_timer = a.min_rnr_timer;
                rq.wire = RespWire::new(a.rq_psn, a.mtu, a.selective_repeat);
                self.holding.store(false, Ordering::Release);
                let remote = a.remote_gid.to_ipv4().map_or(0, |ip| {
                    1u64 << 56 | (u32::from(ip) as u64) << 24 | a.remote_qpn as u64
                });
                self.remote.store(remote, Ordering::Release);
                self.answer_to.store(0, Ordering::Release);
            }
            Modify::Rts(a) => {
                if a.retry_cnt > 7 || a.rnr_retry > 7 || a.timeout > 31 {
                    return Result::Err(Error::InvalidArgument(
                        "retry_cnt, rnr_retry ≤ 7 and timeout ≤ 31",
                    ));
                }
                sq.rts = a;
                if self.is_ud() && from == Rtr {
                    sq.ud_psn = a.sq_psn & 0xff_ffff;
                }
                if let Some(w) = sq.wire.as_mut() {
                    w.set_rts(a.timeout, a.retry_cnt, a.rnr_retry);
                }
            }
            Modify::Reset => {
                sq.ci = 0;
                sq.target = 0;
                for h in 0..self.halves {
                    sq.last_half[h] = self.half_word(h);
                }
                sq.bf = None;
                sq.ahead = ReadAhead::default();
                sq.staged.clear();
                sq.stall = None;
                sq.remote = None;
                sq.peer = None;
                sq.wire = None;
                rq.ci = 0;
                rq.srq_wqe = None;
                rq.wire = Default::default();
                self.last_wqe_raised.store(false, Ordering::Release);
                self.remote.store(0, Ordering::Release);
                self.answer_to.store(0, Ordering::Release);
                if self.dbrec_ext.is_none() {
                    // The device's own record; an external one belongs to its writer.
                    self.ctrl.atomic_u64(DBREC_OFF).store(0, Ordering::Release);
                }
            }
            // the engine flushes what is announced; nothing read ahead is sent
            Modify::Err => sq.staged.clear(),
        }
        self.set_state(to);
        Ok(())
    }

    /// Whether a transition with these attributes is one this QP's transport takes: RC's
    /// INIT and RTR attributes on RC QPs, UD's on UD QPs, DC's RTR on DC initiators and
    /// targets (which take RC's INIT: the remote rights of a target); a DC target has no send
    /// queue and stays in RTR (no RTS), as a ConnectX's DCT.
    fn takes(&self, m: &Modify) -> bool {
        use Transport::*;
        matches!(
            (m, self.transport),
            (
                Modify::Init { .. },
                Rc | Uc | Dci | Dct { .. } | XrcIni | XrcTgt
            ) | (Modify::Rtr(_), Rc | Uc | XrcIni | XrcTgt)
                | (Modify::InitUd { .. } | Modify::RtrUd, Ud)
                | (Modify::RtrDc { .. }, Dci | Dct { .. })
                | (Modify::Rts(_), Rc | Uc | Ud | Dci | XrcIni | XrcTgt)
                | (Modify::Err | Modify::Reset, _)
        )
    }

    /// Injects a fault (tests).
    pub fn inject(&self, f: Fault) {
        let mut sq = self.lock_sq();
        match f {
            Fault::FailNext { count, syndrome } => {
                sq.fail_next = (count > 0).then_some((count, syndrome))
            }
            Fault::DelayCompletions(d) => sq.delay = (!d.is_zero()).then_some(d),
            Fault::DropDoorbells(n) => sq.drop_doorbells = n,
        }
    }

    /// The device's consumer index on the SQ (blocks executed or flushed so far, 16 bits).
    pub fn sq_consumer(&self) -> u16 {
        self.lock_sq().ci
    }

    /// The index up to which the SQ's WQEs are finished: the consumer index, or, while WQEs
    /// handed to the wire transport wait for their answers, the first of them. WQEs before it
    /// will not touch memory any more.
    pub fn sq_finished(&self) -> u16 {
        let sq = self.lock_sq();
        sq.wire.as_ref().and_then(|w| w.oldest()).unwrap_or(sq.ci)
    }

    /// The device's consumer index on the RQ (receive WQEs consumed or flushed so far).
    pub fn rq_consumer(&self) -> u32 {
        self.lock_rq().ci
    }
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.qpn)
            .field("state", &self.state())
            .finish()
    }
}
