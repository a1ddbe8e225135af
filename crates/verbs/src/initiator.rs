//! A CPU initiator: posts WQEs into an SQ, rings the doorbell and polls the CQ through raw ring
//! geometry, exactly as a GPU kernel does. It is a real client of the device, not a shortcut
//! into the engine: it works on any mlx5-format QP whose geometry it is given (a soft NIC's
//! constructor lives with the soft NIC, `softnic::SoftQpInitiator`).

use prm::cqe::{sw_owns, Completion, Cqe64, CqeOpcode, CQE_TAIL_OFFSET};
use prm::doorbell::{DoorbellValue, BF_HALF_SIZE};
use prm::wqe::{blocks_for_ds, CtrlFlags, DataSeg, Op, Sge};
use prm::{CQE_SIZE, WQEBB};
use std::any::Any;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a send queue lives.
#[derive(Clone, Copy, Debug)]
pub struct SqGeometry {
    /// First byte of the ring (64-byte blocks).
    pub ring: *mut u8,
    /// Ring size in blocks (power of two).
    pub blocks: u32,
    /// The 8-byte doorbell record (word 1 is the send word).
    pub dbrec: *mut u8,
    /// The doorbell/BlueFlame register (two halves of [`BF_HALF_SIZE`] bytes).
    pub bf_reg: *mut u8,
    /// QP number.
    pub qpn: u32,
}

/// Where a receive queue lives.
#[derive(Clone, Copy, Debug)]
pub struct RqGeometry {
    /// First byte of the ring.
    pub ring: *mut u8,
    /// Number of WQEs (power of two; 0 = no RQ).
    pub wqes: u32,
    /// Bytes per WQE.
    pub stride: u32,
    /// The doorbell record (word 0 is the receive word).
    pub dbrec: *mut u8,
}

/// Where a completion queue lives.
#[derive(Clone, Copy, Debug)]
pub struct CqGeometry {
    /// First CQE.
    pub ring: *mut u8,
    /// Number of CQEs (power of two).
    pub ncqe: u32,
    /// The CQ doorbell record (word 0: consumer index).
    pub dbrec: *mut u8,
    /// Every CQE lands in slot 0.
    pub collapsed: bool,
}

/// How [`Initiator::ring`] tells the device about new WQEs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingMode {
    /// DBREC, then the first 8 bytes of the last WQE's control segment to the register
    /// (rdma-core), alternating halves.
    RdmaCore,
    /// DBREC, then `{BE32(pi << 8), BE32(qpn << 8)}` to the register (DOCA/UCX).
    Doca,
    /// DBREC, then the whole last WQE copied into the register, alternating halves.
    BlueFlame,
}

/// Initiator errors.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InitiatorError {
    /// The WQE does not fit in the free part of the SQ; poll completions first.
    #[error("send queue full: {need} blocks needed, {free} free")]
    SqFull {
        /// Blocks needed.
        need: u32,
        /// Blocks free.
        free: u32,
    },
    /// The receive queue is full.
    #[error("receive queue full")]
    RqFull,
    /// More SGEs than a receive WQE holds.
    #[error("{0} SGEs do not fit a receive WQE")]
    TooManySges(usize),
    /// The operation cannot be encoded.
    #[error("WQE cannot be built: {0}")]
    Build(prm::BuildError),
    /// No completion arrived in time.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// The CQ is in error after an overrun (its consumer fell a whole ring behind, in
    /// overrun-detect mode): completions were lost, and the QP that produced the refused CQE
    /// is in ERR. Reported once the CQEs still in the ring have been taken.
    #[error("the {0} CQ overran: completions were lost and the CQ is in error")]
    CqOverrun(&'static str),
}

/// Polls one CQ.
pub struct CqPoller {
    g: CqGeometry,
    ci: u32,
    last_collapsed: Option<u32>,
}

// SAFETY: the poller only holds raw pointers into device-visible memory kept alive by the
// initiator's keep-alive handle; all access is through atomics or raw copies.
unsafe impl Send for CqPoller {}

impl CqPoller {
    /// # Safety
    /// The geometry must describe live CQ memory that outlives the poller.
    pub unsafe fn new(g: CqGeometry) -> Self {
        Self {
            g,
            ci: 0,
            last_collapsed: None,
        }
    }

    /// Consumer index (CQEs taken so far).
    pub fn consumer_index(&self) -> u32 {
        self.ci
    }

    /// Continues from the consumer index in the CQ doorbell record (what the CQ's previous
    /// poller last published, 24 bits): the next CQE taken is number `ci`, owned when its owner
    /// bit is `(ci / ncqe) & 1` (ncqe divides 2^24, so the parity survives the truncation). In
    /// collapsed mode the CQE now in slot 0, when there is one, counts as already taken.
    fn resume_from_dbrec(&mut self) {
        // SAFETY: the CQ DBREC's word 0 is live and 4-byte aligned per the geometry contract.
        let word = unsafe { &*(self.g.dbrec as *const AtomicU32) }.load(Ordering::Acquire);
        self.ci = u32::from_be(word) & 0xff_ffff;
        if self.g.collapsed && self.ci != 0 {
            // SAFETY: slot 0's tail word is inside the ring and 4-byte aligned.
            let tail = unsafe { &*(self.g.ring.add(CQE_TAIL_OFFSET) as *const AtomicU32) }
                .load(Ordering::Acquire);
            if tail.to_ne_bytes()[3] >> 4 != CqeOpcode::Invalid as u8 {
                self.last_collapsed = Some(tail);
            }
        }
    }

    /// Takes the next CQE if software owns it.
    pub fn poll(&mut self) -> Option<Cqe64> {
        let slot = if self.g.collapsed {
            0
        } else {
            self.ci & (self.g.ncqe - 1)
        } as usize;
        // SAFETY: slot < ncqe, inside the ring per the geometry contract; the tail word is
        // 4-byte aligned (CQEs are 64-byte aligned).
        let tail_ptr =
            unsafe { self.g.ring.add(slot * CQE_SIZE + CQE_TAIL_OFFSET) } as *const AtomicU32;
        // SAFETY: aligned, live; the device releases this word last.
        let tail = unsafe { &*tail_ptr }.load(Ordering::Acquire);
        let op_own = tail.to_ne_bytes()[3];
        if op_own >> 4 == CqeOpcode::Invalid as u8 {
            return None;
        }
        if self.g.collapsed {
            if self.last_collapsed == Some(tail) {
                return None;
            }
            self.last_collapsed = Some(tail);
        } else if !sw_owns(op_own, self.ci, self.g.ncqe) {
            return None;
        }
        let mut bytes = [0u8; CQE_SIZE];
        // SAFETY: the CQE is inside the ring; its bytes 0..60 were written before the tail
        // release we acquired.
        unsafe {
            std::ptr::copy_nonoverlapping(self.g.ring.add(slot * CQE_SIZE), bytes.as_mut_ptr(), 60)
        };
        bytes[60..].copy_from_slice(&tail.to_ne_bytes());
        self.ci = self.ci.wrapping_add(1);
        // SAFETY: the CQ DBREC's word 0 is live and 4-byte aligned per the geometry contract.
        unsafe { &*(self.g.dbrec as *const AtomicU32) }
            .store((self.ci & 0xff_ffff).to_be(), Ordering::Release);
        Some(bytemuck::cast(bytes))
    }
}

/// Where a new poster continues a queue an earlier poster left ([`Initiator::resume_at`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStart {
    /// The producer index last rung (16-bit block counter).
    pub sq_pi: u16,
    /// Blocks before `sq_pi` not yet retired by a completion (still in flight, or finished
    /// without a CQE yet).
    pub sq_unfinished: u16,
    /// The RQ head (receive WQEs posted, 16-bit counter).
    pub rq_head: u16,
    /// Receive WQEs posted and not yet consumed.
    pub rq_outstanding: u16,
}

/// What a device can tell and do for an initiator beyond its rings (the soft NIC gives all of
/// it; a ConnectX none): each is optional, and an initiator without them polls and yields.
#[derive(Default)]
pub struct DeviceHooks {
    /// Whether the send CQ (index 0) or the receive CQ (1) is in error after an overrun.
    pub cq_error: Option<[Arc<dyn Fn() -> bool + Send + Sync>; 2]>,
    /// Sleeps until the send (0) or receive (1) CQ holds more than `consumed` CQEs (counted
    /// modulo 2^24), at most the given time; returns whether it does.
    pub wait_cq: Option<[CqWait; 2]>,
    /// A number that moves on while the device's engine for this QP runs and stands still
    /// while it does not ([`Initiator::engine_turn`]).
    pub engine_turn: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
    /// Dropped with the initiator (what the device keeps while this poster lives).
    pub guard: Option<Box<dyn Any + Send>>,
}

/// A sleep on a CQ until it holds more than `consumed` CQEs, at most a time.
pub type CqWait = Arc<dyn Fn(u32, Duration) -> bool + Send + Sync>;

/// A CPU client of one QP.
pub struct Initiator {
    sq: SqGeometry,
    rq: RqGeometry,
    send: CqPoller,
    recv: CqPoller,
    mode: RingMode,
    pi: u16,
    sq_ci: u16,
    rq_pi: u32,
    rq_ci: u32,
    half: usize,
    /// `half`'s first 8 bytes were cleared by this initiator's previous ring.
    half_clear: bool,
    /// Blocks of the WQE that starts at each ring slot (to retire on completion).
    sizes: Vec<u8>,
    last: Option<prm::WqeBuf>,
    wake: Option<Arc<dyn Fn() + Send + Sync>>,
    /// What the device tells and does beyond the rings.
    device: DeviceHooks,
    _keep: Arc<dyn Any + Send + Sync>,
    /// Dropped with the initiator (e.g. a claim on the QP that lets one poster at a time in).
    _guard: Option<Box<dyn Any + Send>>,
}

// SAFETY: raw pointers into device-visible memory kept alive by `_keep`; see `CqPoller`.
unsafe impl Send for Initiator {}

impl Initiator {
    /// # Safety
    /// The geometries must describe live, correctly sized device memory of one QP and its CQs,
    /// kept alive by `keep`, and no other client may post to this QP.
    pub unsafe fn from_geometry(
        sq: SqGeometry,
        rq: RqGeometry,
        send_cq: CqGeometry,
        recv_cq: CqGeometry,
        mode: RingMode,
        keep: Arc<dyn Any + Send + Sync>,
        wake: Option<Arc<dyn Fn() + Send + Sync>>,
    ) -> Self {
        Self {
            sq,
            rq,
            // SAFETY: forwarded contract.
            send: unsafe { CqPoller::new(send_cq) },
            // SAFETY: forwarded contract.
            recv: unsafe { CqPoller::new(recv_cq) },
            mode,
            pi: 0,
            sq_ci: 0,
            rq_pi: 0,
            rq_ci: 0,
            half: 0,
            half_clear: false,
            sizes: vec![0; sq.blocks as usize],
            last: None,
            wake,
            device: DeviceHooks::default(),
            _keep: keep,
            _guard: None,
        }
    }

    /// Hands the initiator something to drop when it is dropped (a claim on its QP).
    pub fn with_guard(mut self, guard: Box<dyn Any + Send>) -> Self {
        self._guard = Some(guard);
        self
    }

    /// Hands the initiator what its device can tell and do beyond the rings.
    pub fn with_device(mut self, hooks: DeviceHooks) -> Self {
        self.device = hooks;
        self
    }

    /// Continues from an earlier poster's queue state: the producer index last rung, the SQ
    /// blocks before it not yet retired, the RQ head and the receives posted but not yet
    /// consumed; each CQ poller starts at the consumer index in its CQ doorbell record (owner
    /// parity included). A count larger than its ring cannot be in flight and is taken as 0.
    /// WQEs written but never rung by the earlier poster are overwritten.
    pub fn resume_at(&mut self, s: QueueStart) {
        self.pi = s.sq_pi;
        self.sq_ci = if u32::from(s.sq_unfinished) <= self.sq.blocks {
            s.sq_pi.wrapping_sub(s.sq_unfinished)
        } else {
            s.sq_pi
        };
        self.rq_pi = u32::from(s.rq_head);
        self.rq_ci = if u32::from(s.rq_outstanding) <= self.rq.wqes {
            self.rq_pi.wrapping_sub(u32::from(s.rq_outstanding))
        } else {
            self.rq_pi
        };
        self.send.resume_from_dbrec();
        self.recv.resume_from_dbrec();
    }

    /// Producer index (16-bit block counter of the next WQE).
    pub fn producer(&self) -> u16 {
        self.pi
    }

    /// Blocks not yet retired by a completion.
    pub fn outstanding(&self) -> u32 {
        self.pi.wrapping_sub(self.sq_ci) as u32
    }

    /// Receive WQEs posted and not yet completed (taken by [`Self::poll_recv`]).
    pub fn recv_outstanding(&self) -> u32 {
        self.rq_pi.wrapping_sub(self.rq_ci)
    }

    /// Writes one WQE into the SQ (without ringing). Returns its index.
    pub fn post(&mut self, op: &Op<'_>, flags: CtrlFlags) -> Result<u16, InitiatorError> {
        let w = op
            .encode(self.pi, self.sq.qpn, flags)
            .map_err(InitiatorError::Build)?;
        self.post_wqe(w)
    }

    /// Writes one WQE with an address vector: `op` with the datagram segment `av` after its
    /// control segment (a UD QP's SEND or SEND_IMM, or any operation of a DC initiator:
    /// `DatagramSeg::dc`), without ringing. Returns its index.
    pub fn post_with_av(
        &mut self,
        op: &Op<'_>,
        flags: CtrlFlags,
        av: &prm::wqe::DatagramSeg,
    ) -> Result<u16, InitiatorError> {
        let w = op
            .encode(self.pi, self.sq.qpn, flags)
            .and_then(|w| w.with_datagram(av))
            .map_err(InitiatorError::Build)?;
        self.post_wqe(w)
    }

    /// Posts `op` on an XRC initiator's send queue: its WQE with the XRC segment naming the
    /// target's XRC SRQ `srqn` after the control segment. Not rung.
    pub fn post_with_xrc(
        &mut self,
        op: &Op<'_>,
        flags: CtrlFlags,
        srqn: u32,
    ) -> Result<u16, InitiatorError> {
        let w = op
            .encode(self.pi, self.sq.qpn, flags)
            .and_then(|w| w.with_xrc(srqn))
            .map_err(InitiatorError::Build)?;
        self.post_wqe(w)
    }

    fn post_wqe(&mut self, w: prm::WqeBuf) -> Result<u16, InitiatorError> {
        let need = w.blocks() as u32;
        let free = self.sq.blocks - self.outstanding();
        if need > free {
            return Err(InitiatorError::SqFull { need, free });
        }
        let mask = self.sq.blocks as usize - 1;
        for i in 0..w.blocks() {
            let slot = (self.pi as usize + i) & mask;
            // SAFETY: slot < blocks, inside the ring per the geometry contract; the device
            // only reads slots past its consumer index, which this post owns until the ring.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    w.block(i).as_ptr(),
                    self.sq.ring.add(slot * WQEBB),
                    WQEBB,
                )
            };
        }
        let idx = self.pi;
        self.sizes[idx as usize & mask] = w.blocks() as u8;
        self.pi = self.pi.wrapping_add(need as u16);
        self.last = Some(w);
        Ok(idx)
    }

    /// Tells the device about every WQE posted so far.
    pub fn ring(&mut self) {
        let Some(last) = self.last.take() else { return };
        // SAFETY (both blocks below): the DBREC send word and the register halves are live,
        // aligned device memory per the geometry contract.
        unsafe { &*(self.sq.dbrec.add(4) as *const AtomicU32) }
            .store((self.pi as u32).to_be(), Ordering::Release);
        let bf_fits = last.blocks() * WQEBB <= BF_HALF_SIZE;
        let reg = |h: usize| unsafe { self.sq.bf_reg.add(h * BF_HALF_SIZE) };
        // The device notices a doorbell as a change of a half's first 8 bytes: a value that
        // half already holds (the same index, QPN and size again, e.g. after a RESET took the
        // indices back to 0) goes to the other half, which cannot hold it too.
        let want = match self.mode {
            RingMode::Doca => DoorbellValue::from_pi(self.pi, self.sq.qpn),
            RingMode::BlueFlame if !bf_fits => DoorbellValue::from_pi(self.pi, self.sq.qpn),
            _ => DoorbellValue::from_ctrl(&last.ctrl()),
        };
        // SAFETY: the register's first 8 bytes are 8-byte aligned device memory.
        if unsafe { &*(reg(self.half) as *const AtomicU64) }.load(Ordering::Relaxed)
            == want.to_u64()
        {
            self.half ^= 1;
            self.half_clear = false;
        }
        let value = match self.mode {
            RingMode::RdmaCore => DoorbellValue::from_ctrl(&last.ctrl()),
            RingMode::Doca => DoorbellValue::from_pi(self.pi, self.sq.qpn),
            RingMode::BlueFlame if !bf_fits => DoorbellValue::from_pi(self.pi, self.sq.qpn),
            RingMode::BlueFlame => {
                let bytes = last.as_bytes();
                // Seqlock order (the GPU device API's too): the half's first 8 bytes were
                // cleared by the previous ring (below; the first ring clears them here), this
                // fence orders that clear before bytes 8.., then (below) the first 8 bytes, so
                // a device copying the half can tell it was rewritten.
                if !self.half_clear {
                    // SAFETY: the register's first 8 bytes are 8-byte aligned device memory.
                    unsafe { &*(reg(self.half) as *const AtomicU64) }.store(0, Ordering::Relaxed);
                }
                fence(Ordering::Release);
                // SAFETY: the WQE fits in one register half.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes[8..].as_ptr(),
                        reg(self.half).add(8),
                        bytes.len() - 8,
                    )
                };
                fence(Ordering::Release);
                DoorbellValue::from_ctrl(&last.ctrl())
            }
        };
        // SAFETY: the register's first 8 bytes are 8-byte aligned device memory.
        unsafe { &*(reg(self.half) as *const AtomicU64) }.store(value.to_u64(), Ordering::Release);
        if self.mode != RingMode::Doca {
            self.half ^= 1;
        }
        if self.mode == RingMode::BlueFlame {
            // Clear the next ring's half ahead of it (see the seqlock order above).
            // SAFETY: the register's first 8 bytes are 8-byte aligned device memory.
            unsafe { &*(reg(self.half) as *const AtomicU64) }.store(0, Ordering::Relaxed);
            self.half_clear = true;
        }
        if let Some(w) = &self.wake {
            w();
        }
    }

    /// Posts and rings one WQE.
    pub fn post_and_ring(&mut self, op: &Op<'_>, flags: CtrlFlags) -> Result<u16, InitiatorError> {
        let idx = self.post(op, flags)?;
        self.ring();
        Ok(idx)
    }

    /// Posts a receive WQE (with a terminator when shorter than the stride).
    pub fn post_recv(&mut self, sges: &[Sge]) -> Result<u16, InitiatorError> {
        if self.rq.wqes == 0 || self.rq_pi.wrapping_sub(self.rq_ci) >= self.rq.wqes {
            return Err(InitiatorError::RqFull);
        }
        let slots = (self.rq.stride / 16) as usize;
        if sges.len() > slots {
            return Err(InitiatorError::TooManySges(sges.len()));
        }
        let base = (self.rq_pi & (self.rq.wqes - 1)) as usize * self.rq.stride as usize;
        for i in 0..slots.min(sges.len() + 1) {
            let seg = sges
                .get(i)
                .map_or_else(DataSeg::terminator, |s| DataSeg::new(*s));
            // SAFETY: inside the RQ slot per the geometry contract.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytemuck::bytes_of(&seg).as_ptr(),
                    self.rq.ring.add(base + i * 16),
                    16,
                )
            };
        }
        let idx = self.rq_pi as u16;
        self.rq_pi = self.rq_pi.wrapping_add(1);
        // SAFETY: DBREC receive word, live and aligned.
        unsafe { &*(self.rq.dbrec as *const AtomicU32) }
            .store((self.rq_pi & 0xffff).to_be(), Ordering::Release);
        Ok(idx)
    }

    /// Takes the next send completion, retiring the SQ space it covers.
    pub fn poll_send(&mut self) -> Option<Completion> {
        let c = self.send.poll()?.decode();
        let counter = match c {
            Completion::Req { wqe_counter, .. } => Some(wqe_counter),
            Completion::Error(e) if !e.responder => Some(e.wqe_counter),
            _ => None,
        };
        // Retire only within what is outstanding: an error CQE may name a counter that is
        // not a posted WQE (a refused doorbell reports the device's consumer index, perhaps
        // with nothing posted there) or repeat one already retired; retiring past the
        // producer would make `outstanding` wrap and `post` underflow.
        if let Some(w) = counter {
            let outstanding = self.outstanding();
            if (w.wrapping_sub(self.sq_ci) as u32) < outstanding {
                let blocks = self.sizes[w as usize & (self.sq.blocks as usize - 1)].max(1);
                let end = w.wrapping_add(blocks as u16);
                self.sq_ci = if end.wrapping_sub(self.sq_ci) as u32 <= outstanding {
                    end
                } else {
                    self.pi
                };
            }
        }
        Some(c)
    }

    /// Takes the next receive completion as the device wrote it.
    pub fn poll_recv_raw(&mut self) -> Option<Cqe64> {
        let c = self.recv.poll()?;
        self.retire_recv();
        Some(c)
    }

    /// Counts one receive as completed, never past the ones posted: a poster that took over
    /// the queue counts the receives the device had consumed already as done, and their
    /// completions, still in the CQ, retire nothing more.
    fn retire_recv(&mut self) {
        if self.rq_ci != self.rq_pi {
            self.rq_ci = self.rq_ci.wrapping_add(1);
        }
    }

    /// Takes the next receive completion.
    pub fn poll_recv(&mut self) -> Option<Completion> {
        let c = self.recv.poll()?.decode();
        self.retire_recv();
        Some(c)
    }

    /// Whether the send CQ (`recv` false) or the receive CQ is in error after an overrun
    /// (known for soft-NIC QPs; false where the device cannot say).
    pub fn cq_overrun(&self, recv: bool) -> bool {
        self.device
            .cq_error
            .as_ref()
            .is_some_and(|p| p[usize::from(recv)]())
    }

    /// Waits for the next send completion, at most `timeout`;
    /// [`InitiatorError::CqOverrun`] when the send CQ overran and holds no more CQEs.
    pub fn wait_send(&mut self, timeout: Duration) -> Result<Completion, InitiatorError> {
        let probe = self.device.cq_error.as_ref().map(|p| p[0].clone());
        let sleep = self.sleeper(false);
        let turn = self.turn_probe();
        wait(timeout, "send", probe, sleep, turn, || self.poll_send())
    }

    /// Waits for the next receive completion, at most `timeout`;
    /// [`InitiatorError::CqOverrun`] when the receive CQ overran and holds no more CQEs.
    pub fn wait_recv(&mut self, timeout: Duration) -> Result<Completion, InitiatorError> {
        let probe = self.device.cq_error.as_ref().map(|p| p[1].clone());
        let sleep = self.sleeper(true);
        let turn = self.turn_probe();
        wait(timeout, "receive", probe, sleep, turn, || self.poll_recv())
    }

    /// Gives the core away until the send CQ (`recv` false) or the receive CQ may hold a
    /// completion not yet polled, at most `timeout`, without taking it (poll it next). On a
    /// soft NIC the thread sleeps until the device writes a CQE there, or finds one already
    /// written; elsewhere it yields once. For a loop that polls several initiators and has
    /// nothing to do until one of them completes something.
    pub fn idle_until_completion(&self, recv: bool, timeout: Duration) {
        match self.sleeper(recv) {
            Some(s) => {
                s(timeout);
            }
            None => std::thread::yield_now(),
        }
    }

    /// A soft NIC's engine turn for this QP: a number that moves on while the engine that
    /// runs the QP is running (it spins, or works), and stands still while it sleeps or waits
    /// for a core. A poster that spins for a completion can stop spinning once it saw it
    /// stand still for a while: the engine may be waiting for the poster's own core. `None`
    /// for devices that cannot say.
    pub fn engine_turn(&self) -> Option<u64> {
        self.device.engine_turn.as_ref().map(|t| t())
    }

    /// [`Self::engine_turn`] as a closure that owns what it reads.
    fn turn_probe(&self) -> Option<impl Fn() -> u64 + use<>> {
        let t = self.device.engine_turn.clone()?;
        Some(move || t())
    }

    /// A sleep on the send or receive CQ until it holds a CQE beyond what this initiator
    /// took (where the device can wake a sleeper).
    fn sleeper(&self, recv: bool) -> Option<impl Fn(Duration) -> bool + use<>> {
        let w = self.device.wait_cq.as_ref()?[usize::from(recv)].clone();
        let consumed = if recv { &self.recv } else { &self.send }.consumer_index();
        Some(move |t| w(consumed, t))
    }
}

/// Polls with `f` until it yields a completion, the CQ overran, or `timeout` passed: spins
/// a while, then sleeps on the CQ (`sleep`, when the device can wake it; else yields). It
/// stops spinning early when the engine's `turn` stood still meanwhile (the engine is not
/// running: it may be waiting for this core).
fn wait(
    timeout: Duration,
    which: &'static str,
    overrun: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
    sleep: Option<impl Fn(Duration) -> bool>,
    turn: Option<impl Fn() -> u64>,
    mut f: impl FnMut() -> Option<Completion>,
) -> Result<Completion, InitiatorError> {
    /// Polls before the waiter gives the core away.
    const SPINS: u32 = 1000;
    /// Polls after which it gives the core away when the engine did not run meanwhile.
    const STALL_SPINS: u32 = 16;
    let turn0 = turn.as_ref().map(|t| t());
    /// The longest sleep between checks of the overrun probe and the deadline.
    const NAP: Duration = Duration::from_millis(1);
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if let Some(c) = f() {
            return Ok(c);
        }
        if overrun.as_ref().is_some_and(|o| o()) {
            // Nothing more will be written: take what the ring still holds first.
            return f().ok_or(InitiatorError::CqOverrun(which));
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            return Err(InitiatorError::Timeout(timeout));
        }
        spins += 1;
        let stalled = spins > STALL_SPINS && turn.as_ref().map(|t| t()) == turn0 && turn0.is_some();
        match &sleep {
            _ if spins <= SPINS && !stalled => std::hint::spin_loop(),
            Some(s) => {
                s((timeout - elapsed).min(NAP));
            }
            None => std::thread::yield_now(),
        }
    }
}

/// Blocks of an encoded WQE of `ds` units (re-exported for callers sizing rings).
pub fn wqe_blocks(ds: u8) -> usize {
    blocks_for_ds(ds)
}
