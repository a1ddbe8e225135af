//! Completion queues: a ring of 64- or 128-byte entries with per-lap owner bits, each CQE
//! written the way a ConnectX writes it (bytes 0..60, then the last 4 bytes released with one
//! store). In a ring of 128-byte entries the 64-byte CQE is the second half of its entry (the
//! first half is where a ConnectX scatters inline data, which the soft NIC does not do: it
//! leaves the first half untouched and never sets the CQE's inline-scatter format bits).
//!
//! The ring may be host memory or device memory ([`DmaBuf::from_device`]); in device memory the
//! two parts are two ordered writes through its [`crate::DeviceMemory`], and a write that fails
//! puts the CQ in error for good (as a ConnectX's CQ error after a PCIe fault). The CQ doorbell
//! record is always host memory.

use crate::buffer::DmaBuf;
use crate::event::{AsyncEvent, EventHandler, EventSlot};
use prm::cqe::{owner_bit, Cqe64, CqeOpcode, CQE_TAIL_OFFSET};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
pub use verbs::cq::{CqInit, CqMode, CqeSize};

/// `op_own` of the CQE a resize writes into the old ring (opcode `MLX5_CQE_RESIZE_CQ`).
pub const RESIZE_OP_OWN: u8 = 5 << 4;

/// Parameters of a new CQ.
#[derive(Debug, Default)]
pub struct CqConfig {
    /// Number of CQEs (power of two).
    pub ncqe: u32,
    /// Consumer-index mode.
    pub mode: CqMode,
    /// Initial `op_own`.
    pub init: CqInit,
    /// Ring memory (at least `ncqe` entries of `cqe_size`), host or device memory; allocated
    /// in host memory when `None`.
    pub ring: Option<DmaBuf>,
    /// The size of the ring's entries.
    pub cqe_size: CqeSize,
    /// The CQ doorbell record (8 bytes of host memory: consumer index, arm word), in memory
    /// the consumer allocated, as a verbs provider does; allocated by the device when `None`.
    pub dbrec: Option<DmaBuf>,
}

/// Why a CQE could not be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CqError {
    /// The consumer fell a whole ring behind (overrun-detect mode); the CQ is in error.
    #[error("CQ {0:#x} overrun")]
    Overrun(u32),
    /// Writing this CQE into the ring (device memory) failed; the CQ is in error.
    #[error("CQ {0:#x}: writing a CQE to device memory failed")]
    DeviceMemory(u32),
    /// The CQ is in error after a failed CQE write; nothing more is written.
    #[error("CQ {0:#x} is in error")]
    Failed(u32),
    /// The CQ was destroyed (a QP still running on an engine's snapshot): nothing is written.
    #[error("CQ {0:#x} was destroyed")]
    Destroyed(u32),
}

struct CqState {
    /// CQEs produced so far (the producer index).
    pi: u32,
    /// The consumer index last read from the doorbell record. The consumer only moves it
    /// forward, so while `pi` is less than a ring ahead of it the ring has room and the
    /// record need not be read again (a copy each time in device memory); it is read again
    /// before an overrun is declared.
    ci_seen: u32,
    /// The ring the CQ writes into after [`Cq::resize`] (the creation ring when `None`).
    resized: Option<DmaBuf>,
    /// The entry size of the ring it writes into.
    cqe_size: CqeSize,
    overrun: bool,
    failed: bool,
    /// Set by [`Cq::retire`]: no CQE is written any more.
    destroyed: bool,
    /// The numbers of the last error CQEs written, as runs `[first, end)` (at most
    /// [`ERROR_RUNS`] of them, oldest first): what a WAIT on one of them finds.
    errors: VecDeque<(u32, u32)>,
    delayed: VecDeque<(Instant, Cqe64)>,
}

/// Whether a CQ of `ncqe` entries with producer index `pi` has room for one more CQE while its
/// consumer index is `ci` (24-bit counters).
fn has_room(pi: u32, ci: u32, ncqe: u32) -> bool {
    pi.wrapping_sub(ci) & 0xff_ffff < ncqe
}

/// [`verbs::cq::prefill`], with the soft NIC's error.
pub fn prefill(ring: &DmaBuf, ncqe: usize, init: CqInit) -> Result<(), crate::Error> {
    Ok(verbs::cq::prefill(ring, ncqe, init)?)
}

/// [`verbs::cq::prefill_sized`], with the soft NIC's error.
pub fn prefill_sized(
    ring: &DmaBuf,
    ncqe: usize,
    init: CqInit,
    size: CqeSize,
) -> Result<(), crate::Error> {
    Ok(verbs::cq::prefill_sized(ring, ncqe, init, size)?)
}

/// A completion queue.
pub struct Cq {
    cqn: u32,
    ncqe: AtomicU32,
    mode: CqMode,
    ring: DmaBuf,
    dbrec: DmaBuf,
    state: Mutex<CqState>,
    produced: AtomicU32,
    /// Threads blocked in [`Cq::wait_produced`], and what wakes them.
    waiters: AtomicU32,
    waiting: parking_lot::Mutex<()>,
    written: parking_lot::Condvar,
    /// The thread [`Cq::wake_at_next_write`] wakes, and whether it asked to be.
    watcher: parking_lot::Mutex<Option<std::thread::Thread>>,
    watch_next: AtomicBool,
    pub(crate) events: EventSlot,
}

impl Cq {
    pub(crate) fn new(cqn: u32, cfg: CqConfig) -> Result<Self, crate::Error> {
        if cfg.ncqe == 0 || !cfg.ncqe.is_power_of_two() || cfg.ncqe > 1 << 22 {
            return Err(crate::Error::InvalidArgument(
                "CQ size must be a power of two ≤ 2^22",
            ));
        }
        let bytes = cfg.ncqe as usize * cfg.cqe_size.bytes();
        let dbrec = match cfg.dbrec {
            Some(d) if d.len() < 8 => {
                return Err(crate::Error::InvalidArgument(
                    "CQ doorbell record must be 8 bytes",
                ))
            }
            Some(d) => d,
            None => DmaBuf::alloc(64),
        };
        let ring = match cfg.ring {
            Some(r) if r.len() < bytes => {
                return Err(crate::Error::InvalidArgument(
                    "CQ ring memory smaller than ncqe entries",
                ))
            }
            Some(r) => r,
            None => DmaBuf::alloc(bytes),
        };
        prefill_sized(&ring, cfg.ncqe as usize, cfg.init, cfg.cqe_size)?;
        Ok(Self {
            cqn,
            ncqe: AtomicU32::new(cfg.ncqe),
            mode: cfg.mode,
            ring,
            dbrec,
            events: EventSlot::default(),
            state: Mutex::new(CqState {
                pi: 0,
                ci_seen: 0,
                resized: None,
                cqe_size: cfg.cqe_size,
                overrun: false,
                failed: false,
                destroyed: false,
                errors: VecDeque::new(),
                delayed: VecDeque::new(),
            }),
            produced: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            waiting: parking_lot::Mutex::new(()),
            written: parking_lot::Condvar::new(),
            watcher: parking_lot::Mutex::new(None),
            watch_next: AtomicBool::new(false),
        })
    }

    /// CQ number.
    pub fn cqn(&self) -> u32 {
        self.cqn
    }
    /// Number of entries (the new number after [`Cq::resize`]).
    pub fn ncqe(&self) -> u32 {
        self.ncqe.load(Ordering::Acquire)
    }
    /// Consumer-index mode.
    pub fn mode(&self) -> CqMode {
        self.mode
    }
    /// The size of the entries of the ring it writes into (the new size after
    /// [`Cq::resize`]).
    pub fn cqe_size(&self) -> CqeSize {
        self.lock().cqe_size
    }
    /// The ring the CQ was created with (a resized CQ writes into the ring given to
    /// [`Cq::resize`]).
    pub fn ring(&self) -> &DmaBuf {
        &self.ring
    }
    /// The CQ doorbell record (word 0: consumer index, word 1: arm).
    pub fn dbrec(&self) -> &DmaBuf {
        &self.dbrec
    }
    /// CQEs written so far.
    pub fn produced(&self) -> u32 {
        self.produced.load(Ordering::Acquire)
    }

    /// Whether the CQE numbered `index` (from 0, since the CQ was made) has been written: the
    /// count written is past it, in 24-bit serial arithmetic (the CQ index width; the upper
    /// bits of `index` are ignored, and an index up to 2^23 behind counts as written). What a
    /// cross-channel WAIT's `max_index` names (docs/softnic.md, "What WAIT waits for").
    pub fn has_written(&self, index: u32) -> bool {
        self.produced().wrapping_sub(index).wrapping_sub(1) & 0xff_ffff < 0x80_0000
    }

    /// Whether CQE number `index` (numbered as [`Cq::has_written`] numbers them) was written
    /// as an error CQE (a failed WQE or a flushed one). Only the last [`ERROR_RUNS`] runs of
    /// error CQEs are remembered: a WAIT asks about a CQE just written.
    pub fn wrote_error(&self, index: u32) -> bool {
        let st = self.lock();
        st.errors.iter().any(|&(first, end)| {
            (index.wrapping_sub(first) & 0xff_ffff) < (end.wrapping_sub(first) & 0xff_ffff)
        })
    }

    /// Blocks until the CQ holds a CQE its consumer has not taken — more than `consumed`
    /// written (both counted modulo 2^24, as the doorbell record's consumer index) — or
    /// `timeout` passes; returns whether it does. What a CQ's completion event is to a
    /// ConnectX's consumer, without arming: a poller that would otherwise spin gives its core
    /// to the device's threads (the soft NIC shares the CPU with it) and is woken by the write.
    pub fn wait_beyond(&self, consumed: u32, timeout: Duration) -> bool {
        let pending = || (self.produced.load(Ordering::SeqCst) ^ consumed) & 0xff_ffff != 0;
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let mut g = self.waiting.lock();
        // checked under the lock the writer takes to wake: no write slips in between
        if !pending() {
            let _ = self.written.wait_for(&mut g, timeout);
        }
        drop(g);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        pending()
    }
    /// Names the thread that [`Cq::wake_at_next_write`] wakes (or none): one that watches
    /// many CQs at once, as an emulated kernel's completion-event watcher does.
    pub fn set_watcher(&self, t: Option<std::thread::Thread>) {
        *self.watcher.lock() = t;
    }

    /// Asks for one wake-up (`unpark`) of the watcher when the next CQE is written; the
    /// watcher asks again each time. A watcher that asks and then finds `produced` unchanged
    /// may sleep: a write after its look wakes it (both sides are sequentially consistent).
    pub fn wake_at_next_write(&self) {
        self.watch_next.store(true, Ordering::SeqCst);
    }

    /// Whether the next CQE written wakes the watcher ([`Cq::wake_at_next_write`]): the CQ is
    /// armed, and its program may be waiting for the completion event.
    pub fn wakes_watcher(&self) -> bool {
        self.watch_next.load(Ordering::SeqCst)
    }

    /// Whether the CQ is in error after an overrun.
    pub fn is_overrun(&self) -> bool {
        self.lock().overrun
    }
    /// Whether the CQ is in error after a CQE write to its (device-memory) ring failed.
    pub fn is_failed(&self) -> bool {
        self.lock().failed
    }

    /// Sets (or clears) the receiver of this CQ's asynchronous events.
    pub fn set_event_handler(&self, h: Option<EventHandler>) {
        self.events.set(h);
    }

    /// Resizes the CQ as a ConnectX does for the mlx5 provider: the device writes one CQE of
    /// opcode RESIZE_CQ (5) into the old ring at the producer index and writes every later
    /// CQE into `ring` of `ncqe` entries, the index space continuing (the next CQE goes to
    /// slot `pi + 1` of the new ring, with the new ring's owner bit). The provider copies the
    /// CQEs it has not polled, up to the RESIZE CQE, to the new ring itself. The new ring
    /// must hold the CQEs not yet consumed plus the next one (overrun-detect mode), and the
    /// old ring must have room for the RESIZE CQE.
    pub fn resize(&self, ncqe: u32, ring: DmaBuf) -> Result<(), crate::Error> {
        let size = self.cqe_size();
        self.resize_sized(ncqe, ring, size)
    }

    /// [`Cq::resize`] into a ring of `size` entries (MODIFY_CQ's resize may change the CQE
    /// size; the RESIZE CQE goes into the old ring at the old size).
    pub fn resize_sized(&self, ncqe: u32, ring: DmaBuf, size: CqeSize) -> Result<(), crate::Error> {
        if ncqe < 2 || !ncqe.is_power_of_two() || ncqe > 1 << 22 {
            return Err(crate::Error::InvalidArgument(
                "CQ size must be a power of two in 2..=2^22",
            ));
        }
        if ring.len() < ncqe as usize * size.bytes() {
            return Err(crate::Error::InvalidArgument(
                "CQ ring memory smaller than ncqe entries",
            ));
        }
        if self.mode == CqMode::Collapsed {
            return Err(crate::Error::InvalidArgument(
                "a collapsed CQ is not resized",
            ));
        }
        let mut st = self.lock();
        if st.overrun || st.failed || st.destroyed {
            return Err(crate::Error::Busy("CQ in error"));
        }
        if self.mode == CqMode::OverrunDetect {
            let ci = self
                .dbrec
                .load_u32_acquire(0)
                .map_err(|_| crate::Error::Busy("CQ doorbell record unreadable"))?;
            let ci = u32::from_be(ci) & 0xff_ffff;
            let pending = st.pi.wrapping_sub(ci) & 0xff_ffff;
            if pending + 1 > ncqe || pending >= self.ncqe() {
                return Err(crate::Error::InvalidArgument(
                    "the new CQ size cannot hold the CQEs not yet polled",
                ));
            }
        }
        // The RESIZE CQE, in the old ring.
        self.write_locked(&mut st, Cqe64::invalid(RESIZE_OP_OWN))
            .map_err(|_| crate::Error::Busy("CQ in error"))?;
        st.resized = Some(ring);
        st.cqe_size = size;
        self.ncqe.store(ncqe, Ordering::Release);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CqState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes a CQE now, or at `due` when completions are being delayed.
    pub(crate) fn push(&self, cqe: Cqe64, due: Option<Instant>) -> Result<(), CqError> {
        let mut st = self.lock();
        match due {
            Some(t) => {
                st.delayed.push_back((t, cqe));
                Ok(())
            }
            None if !st.delayed.is_empty() => {
                // keep completion order behind delayed entries
                st.delayed.push_back((Instant::now(), cqe));
                Ok(())
            }
            None => self.write_locked(&mut st, cqe),
        }
    }

    /// Writes delayed CQEs whose time has come. Returns whether any remain.
    pub(crate) fn flush_due(&self, now: Instant) -> Result<bool, CqError> {
        let mut st = self.lock();
        while let Some(&(t, cqe)) = st.delayed.front() {
            if t > now {
                return Ok(true);
            }
            st.delayed.pop_front();
            self.write_locked(&mut st, cqe)?;
        }
        Ok(false)
    }

    /// Destroys the CQ as the device sees it: delayed CQEs are dropped, and once this returns
    /// no CQE is written into its ring (writers hold the CQ's lock and check the flag), so its
    /// owner may free the ring and the doorbell record.
    pub(crate) fn retire(&self) {
        let mut st = self.lock();
        st.destroyed = true;
        st.delayed.clear();
    }

    fn write_locked(&self, st: &mut CqState, mut cqe: Cqe64) -> Result<(), CqError> {
        if st.destroyed {
            return Err(CqError::Destroyed(self.cqn));
        }
        if st.overrun {
            return Err(CqError::Overrun(self.cqn));
        }
        if st.failed {
            return Err(CqError::Failed(self.cqn));
        }
        if self.mode == CqMode::OverrunDetect && !has_room(st.pi, st.ci_seen, self.ncqe()) {
            // the consumer index, from a record in host memory or (a copy) in device memory
            let ci = match self.dbrec.load_u32_acquire(0) {
                Ok(w) => u32::from_be(w) & 0xff_ffff,
                Err(_) => {
                    st.failed = true;
                    self.events.raise(AsyncEvent::CqError);
                    return Err(CqError::DeviceMemory(self.cqn));
                }
            };
            st.ci_seen = ci;
            if !has_room(st.pi, ci, self.ncqe()) {
                st.overrun = true;
                tracing::debug!(cqn = self.cqn, "CQ overrun");
                self.events.raise(AsyncEvent::CqError);
                return Err(CqError::Overrun(self.cqn));
            }
        }
        let ncqe = self.ncqe();
        let slot = match self.mode {
            CqMode::Collapsed => 0,
            _ => st.pi & (ncqe - 1),
        } as usize;
        // an error CQE holds its syndromes where a completion's timestamp goes
        let error = [CqeOpcode::ReqErr as u8, CqeOpcode::RespErr as u8].contains(&cqe.opcode());
        if !error {
            cqe.timestamp = prm::Be64::new(crate::clock::now());
        }
        cqe.op_own = (cqe.op_own & !1) | owner_bit(st.pi, ncqe);
        let (head, tail) = cqe.split_for_release();
        let off = slot * st.cqe_size.bytes() + st.cqe_size.cqe_offset();
        // Two ordered writes: a consumer that sees the tail (acquire) sees the head.
        let ring = st.resized.as_ref().unwrap_or(&self.ring);
        let written = ring.write_then_release(off, &head, off + CQE_TAIL_OFFSET, tail);
        if let Err(e) = written {
            tracing::warn!(cqn = self.cqn, error = %e, "CQE write failed: CQ in error");
            st.failed = true;
            self.events.raise(AsyncEvent::CqError);
            return Err(CqError::DeviceMemory(self.cqn));
        }
        if error {
            note_error(&mut st.errors, st.pi);
        }
        st.pi = st.pi.wrapping_add(1);
        // SeqCst: a waiter that registers after this sees the new count, or is seen here
        self.produced.store(st.pi, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.waiting.lock();
            self.written.notify_all();
        }
        if self.watch_next.load(Ordering::SeqCst) && self.watch_next.swap(false, Ordering::SeqCst) {
            if let Some(t) = &*self.watcher.lock() {
                t.unpark();
            }
        }
        Ok(())
    }
}

/// How many runs of consecutive error CQEs a CQ remembers ([`Cq::wrote_error`]).
const ERROR_RUNS: usize = 16;

/// Records error CQE number `n`: extends the last run when it ends at `n`, else starts one.
fn note_error(runs: &mut VecDeque<(u32, u32)>, n: u32) {
    if let Some(last) = runs.back_mut() {
        if last.1 == n {
            last.1 = n.wrapping_add(1);
            return;
        }
    }
    if runs.len() == ERROR_RUNS {
        runs.pop_front();
    }
    runs.push_back((n, n.wrapping_add(1)));
}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cq")
            .field("cqn", &self.cqn)
            .field("ncqe", &self.ncqe())
            .field("mode", &self.mode)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prm::cqe::sw_owns;

    fn read(cq: &Cq, slot: usize) -> Cqe64 {
        let mut b = [0u8; 64];
        cq.ring().read(slot * 64, &mut b);
        bytemuck::cast(b)
    }

    #[test]
    fn error_cqe_numbers_are_kept_as_runs_the_last_sixteen() {
        let mut runs = VecDeque::new();
        for n in [5, 6, 7, 9] {
            note_error(&mut runs, n);
        }
        assert_eq!(runs, [(5, 8), (9, 10)]);
        for n in 0..20u32 {
            note_error(&mut runs, 100 + 2 * n);
        }
        assert_eq!(runs.len(), ERROR_RUNS);
        assert_eq!(runs.front(), Some(&(108, 109)));
        // a run across the 32-bit wrap stays one run
        let mut wrap = VecDeque::new();
        note_error(&mut wrap, u32::MAX);
        note_error(&mut wrap, 0);
        assert_eq!(wrap, [(u32::MAX, 1)]);
    }

    #[test]
    fn a_watcher_that_asked_is_woken_by_the_next_write_and_only_that_one() {
        let cq = std::sync::Arc::new(
            Cq::new(
                1,
                CqConfig {
                    ncqe: 8,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let watcher = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                cq.set_watcher(Some(std::thread::current()));
                cq.wake_at_next_write();
                tx.send(()).unwrap();
                // an unpark may come early (a spurious return): wait for the count itself;
                // without the write's unpark this sleeps the whole minute
                let start = Instant::now();
                while cq.produced() == 0 && start.elapsed() < Duration::from_secs(60) {
                    std::thread::park_timeout(Duration::from_secs(60));
                }
                (cq.produced(), start.elapsed())
            })
        };
        rx.recv().unwrap();
        assert!(cq.watch_next.load(Ordering::SeqCst));
        cq.push(Cqe64::requester(8, 1, 0, 0, 0), None).unwrap();
        // the ask is spent: a second write wakes no one
        assert!(!cq.watch_next.load(Ordering::SeqCst));
        let (produced, slept) = watcher.join().unwrap();
        assert_eq!(produced, 1);
        assert!(
            slept < Duration::from_secs(30),
            "not woken by the write: {slept:?}"
        );
        cq.push(Cqe64::requester(8, 2, 0, 0, 0), None).unwrap();
        assert!(!cq.watch_next.load(Ordering::SeqCst));
    }

    #[test]
    fn completions_carry_the_clock_and_errors_keep_their_syndromes() {
        let cq = Cq::new(
            1,
            CqConfig {
                ncqe: 4,
                ..Default::default()
            },
        )
        .unwrap();
        let before = crate::clock::now();
        cq.push(Cqe64::requester(8, 1, 0, 0, 0), None).unwrap();
        let after = crate::clock::now();
        let stamp = read(&cq, 0).timestamp.get();
        assert!(
            before <= stamp && stamp <= after,
            "{before} {stamp} {after}"
        );
        let e = prm::cqe::ErrorCqe {
            responder: false,
            syndrome: prm::Syndrome::RemoteAccess as u8,
            vendor_syndrome: 0x8a,
            wqe_opcode: 8,
            qpn: 1,
            wqe_counter: 1,
        };
        cq.push(Cqe64::error(&e, 0), None).unwrap();
        assert_eq!(read(&cq, 1).decode(), prm::Completion::Error(e));
    }

    #[test]
    fn a_waiting_poller_is_woken_by_the_write_and_times_out_without_one() {
        let cq = std::sync::Arc::new(
            Cq::new(
                1,
                CqConfig {
                    ncqe: 4,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        // nothing written: the wait runs out and says so
        let t0 = Instant::now();
        assert!(!cq.wait_beyond(0, Duration::from_millis(20)));
        assert!(t0.elapsed() >= Duration::from_millis(20));
        // a write while it sleeps ends the wait well before its timeout
        let w = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                cq.push(Cqe64::requester(8, 1, 0, 0, 0), None).unwrap();
            })
        };
        let t0 = Instant::now();
        assert!(cq.wait_beyond(0, Duration::from_secs(10)));
        assert!(t0.elapsed() < Duration::from_secs(10));
        w.join().unwrap();
        // a CQE not yet taken: no wait at all; taken (consumer 1): waits again
        assert!(cq.wait_beyond(0, Duration::from_secs(10)));
        assert!(!cq.wait_beyond(1, Duration::from_millis(1)));
    }

    #[test]
    fn owner_bit_flips_per_lap_and_init_fill() {
        for (init, byte) in [(CqInit::Invalid, 0xf0), (CqInit::InvalidOwned, 0xf1)] {
            let cq = Cq::new(
                1,
                CqConfig {
                    ncqe: 4,
                    init,
                    ..Default::default()
                },
            )
            .unwrap();
            assert_eq!(read(&cq, 3).op_own, byte);
            assert!(!sw_owns(read(&cq, 0).op_own, 0, 4));
            for i in 0..10u32 {
                cq.push(Cqe64::requester(8, 1, i as u16, 0, 0), None)
                    .unwrap();
                let c = read(&cq, (i % 4) as usize);
                assert!(sw_owns(c.op_own, i, 4), "cqe {i}");
                assert_eq!(c.wqe_counter.get(), i as u16);
            }
        }
    }

    #[test]
    fn device_ring_fill_and_cqes_go_through_the_trait() {
        use crate::devmem::SimDeviceMemory;
        let m = SimDeviceMemory::new(4 << 20);
        let ncqe = 1u32 << 15; // 2 MiB: filled in two writes
        let ring = DmaBuf::from_device(m.base(), ncqe as usize * 64, m.clone(), Box::new(()));
        let cq = Cq::new(
            5,
            CqConfig {
                ncqe,
                ring: Some(ring),
                init: CqInit::InvalidOwned,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(m.counts().writes, 2);
        let last = m.peek(m.base() + (ncqe as u64 - 1) * 64, 64);
        assert_eq!(last[63], 0xf1);
        cq.push(Cqe64::requester(8, 1, 7, 0, 0), None).unwrap();
        assert_eq!(m.counts().writes, 4, "a CQE is two writes");
        let c: Cqe64 = bytemuck::pod_read_unaligned(&m.peek(m.base(), 64));
        assert!(sw_owns(c.op_own, 0, ncqe));
        assert_eq!(c.wqe_counter.get(), 7);
        m.fail_range(m.base() + 64, 64);
        assert_eq!(
            cq.push(Cqe64::requester(8, 1, 8, 0, 0), None),
            Err(CqError::DeviceMemory(5))
        );
        assert!(cq.is_failed());
        m.heal();
        assert_eq!(
            cq.push(Cqe64::requester(8, 1, 9, 0, 0), None),
            Err(CqError::Failed(5))
        );
    }

    /// A second view of `b` (the test keeps reading the ring it hands to a resize).
    fn alias(b: &std::sync::Arc<DmaBuf>) -> DmaBuf {
        let p = std::ptr::NonNull::new(b.as_ptr()).unwrap();
        // SAFETY: host memory of `b`, kept alive by the Arc the view owns; only accessed
        // through DmaBuf's own reads and writes.
        unsafe { DmaBuf::from_external(p, b.len(), Box::new(b.clone())) }
    }

    /// The 128-byte entry at `slot`: (first half, the CQE in the second half).
    fn read128(ring: &DmaBuf, slot: usize) -> ([u8; 64], Cqe64) {
        let mut b = [0u8; 128];
        ring.read(slot * 128, &mut b);
        let mut first = [0u8; 64];
        first.copy_from_slice(&b[..64]);
        (first, bytemuck::pod_read_unaligned(&b[64..]))
    }

    fn cq128(ncqe: u32, mode: CqMode, init: CqInit) -> Cq {
        Cq::new(
            9,
            CqConfig {
                ncqe,
                mode,
                init,
                cqe_size: CqeSize::B128,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn cqes_of_128_bytes_are_the_second_half_of_each_entry_owner_per_entry() {
        for (init, byte) in [(CqInit::Invalid, 0xf0), (CqInit::InvalidOwned, 0xf1)] {
            let cq = cq128(4, CqMode::OverrunIgnore, init);
            assert_eq!(cq.cqe_size(), CqeSize::B128);
            assert!(cq.ring().len() >= 4 * 128);
            // prefill: the invalid op_own at byte 127 of every entry, first halves zero
            for slot in 0..4 {
                let (first, c) = read128(cq.ring(), slot);
                assert_eq!(first, [0u8; 64], "slot {slot}");
                assert_eq!(c.op_own, byte, "slot {slot}");
                assert!(!sw_owns(c.op_own, slot as u32, 4));
            }
            // the first halves are the consumer's (inline scatter, not done): never written
            for slot in 0..4 {
                cq.ring().write(slot * 128, &[0xab; 64]);
            }
            for i in 0..11u32 {
                cq.push(Cqe64::requester(8, 0x42, i as u16, 7, 0), None)
                    .unwrap();
                let slot = (i % 4) as usize;
                let (first, c) = read128(cq.ring(), slot);
                assert_eq!(first, [0xab; 64], "cqe {i}: first half touched");
                assert!(sw_owns(c.op_own, i, 4), "cqe {i}");
                assert_eq!(c.op_own & 1, ((i / 4) & 1) as u8, "cqe {i} owner bit");
                // no inline-scatter format bits (bits 3:2 of op_own)
                assert_eq!(c.op_own & 0x0c, 0, "cqe {i}");
                assert_eq!(c.opcode(), 0);
                assert_eq!(c.wqe_counter.get(), i as u16);
                assert_eq!(c.byte_cnt.get(), 7);
                // the next entry is not yet software's
                let (_, next) = read128(cq.ring(), (slot + 1) % 4);
                assert!(!sw_owns(next.op_own, i + 1, 4), "cqe {i}: next entry");
            }
        }
        // a ring short of ncqe * 128 bytes is refused (enough for 64-byte entries)
        let r = Cq::new(
            1,
            CqConfig {
                ncqe: 64,
                ring: Some(DmaBuf::alloc(64 * 64)),
                cqe_size: CqeSize::B128,
                ..Default::default()
            },
        );
        assert!(r.is_err());
        assert_eq!(CqeSize::from_bytes(128), Some(CqeSize::B128));
        assert_eq!(CqeSize::from_bytes(64), Some(CqeSize::B64));
        assert_eq!(CqeSize::from_bytes(32), None);
    }

    #[test]
    fn untouched_128_byte_ring_and_device_memory() {
        use crate::devmem::SimDeviceMemory;
        let cq = cq128(2, CqMode::OverrunIgnore, CqInit::Untouched);
        assert_eq!(read128(cq.ring(), 1).0, [0u8; 64]);
        let m = SimDeviceMemory::new(1 << 20);
        let ring = DmaBuf::from_device(m.base(), 8 * 128, m.clone(), Box::new(()));
        let cq = Cq::new(
            5,
            CqConfig {
                ncqe: 8,
                ring: Some(ring),
                init: CqInit::InvalidOwned,
                cqe_size: CqeSize::B128,
                ..Default::default()
            },
        )
        .unwrap();
        let e = m.peek(m.base() + 7 * 128, 128);
        assert_eq!(e[127], 0xf1);
        assert_eq!(e[63], 0);
        cq.push(Cqe64::requester(8, 1, 3, 0, 0), None).unwrap();
        let c: Cqe64 = bytemuck::pod_read_unaligned(&m.peek(m.base() + 64, 64));
        assert!(sw_owns(c.op_own, 0, 8));
        assert_eq!(c.wqe_counter.get(), 3);
        assert_eq!(m.peek(m.base(), 64), vec![0u8; 64]);
    }

    #[test]
    fn overrun_detect_and_collapsed_with_128_byte_entries() {
        let cq = cq128(2, CqMode::OverrunDetect, CqInit::Invalid);
        cq.push(Cqe64::requester(8, 1, 0, 0, 0), None).unwrap();
        cq.push(Cqe64::requester(8, 1, 1, 0, 0), None).unwrap();
        assert_eq!(
            cq.push(Cqe64::requester(8, 1, 2, 0, 0), None),
            Err(CqError::Overrun(9))
        );
        assert!(cq.is_overrun());
        // entries 0 and 1 hold CQEs 0 and 1; nothing was written past them
        assert_eq!(read128(cq.ring(), 0).1.wqe_counter.get(), 0);
        assert_eq!(read128(cq.ring(), 1).1.wqe_counter.get(), 1);

        // a consumer that keeps up wraps the ring any number of times
        let cq = cq128(2, CqMode::OverrunDetect, CqInit::Invalid);
        for i in 0..7u32 {
            cq.push(Cqe64::requester(8, 1, i as u16, 0, 0), None)
                .unwrap();
            let c = read128(cq.ring(), (i % 2) as usize).1;
            assert!(sw_owns(c.op_own, i, 2), "cqe {i}");
            cq.dbrec()
                .atomic_u32(0)
                .store((i + 1).to_be(), Ordering::Release);
        }

        let cq = cq128(1, CqMode::Collapsed, CqInit::Invalid);
        cq.ring().write(0, &[0x5a; 64]);
        for i in 0..5u16 {
            cq.push(Cqe64::requester(8, 1, i, 0, 0), None).unwrap();
            let (first, c) = read128(cq.ring(), 0);
            assert_eq!(c.wqe_counter.get(), i);
            assert_eq!(first, [0x5a; 64]);
        }
    }

    #[test]
    fn resize_between_cqe_sizes() {
        // 64 -> 128: the RESIZE CQE in the old ring at 64-byte stride, later CQEs in the new
        // ring's second halves, the index space continuing
        let cq = Cq::new(
            6,
            CqConfig {
                ncqe: 4,
                mode: CqMode::OverrunDetect,
                ..Default::default()
            },
        )
        .unwrap();
        cq.push(Cqe64::requester(8, 1, 0, 0, 0), None).unwrap();
        let new = std::sync::Arc::new(DmaBuf::alloc(8 * 128));
        assert!(cq
            .resize_sized(64, DmaBuf::alloc(64 * 64), CqeSize::B128)
            .is_err());
        cq.resize_sized(8, alias(&new), CqeSize::B128).unwrap();
        assert_eq!(read(&cq, 1).op_own & 0xfe, RESIZE_OP_OWN);
        assert_eq!(cq.cqe_size(), CqeSize::B128);
        cq.push(Cqe64::requester(8, 1, 2, 0, 0), None).unwrap();
        let (first, c) = read128(&new, 2);
        assert_eq!(first, [0u8; 64]);
        assert_eq!(c.wqe_counter.get(), 2);
        assert!(sw_owns(c.op_own, 2, 8));

        // 128 -> 64 (and a plain resize keeps the size)
        let cq = cq128(4, CqMode::OverrunIgnore, CqInit::Invalid);
        cq.push(Cqe64::requester(8, 1, 0, 0, 0), None).unwrap();
        let same = std::sync::Arc::new(DmaBuf::alloc(8 * 128));
        cq.resize(8, alias(&same)).unwrap();
        assert_eq!(read128(cq.ring(), 1).1.op_own & 0xfe, RESIZE_OP_OWN);
        cq.push(Cqe64::requester(8, 1, 2, 0, 0), None).unwrap();
        assert_eq!(read128(&same, 2).1.wqe_counter.get(), 2);
        let small = std::sync::Arc::new(DmaBuf::alloc(16 * 64));
        cq.resize_sized(16, alias(&small), CqeSize::B64).unwrap();
        assert_eq!(read128(&same, 3).1.op_own & 0xfe, RESIZE_OP_OWN);
        cq.push(Cqe64::requester(8, 1, 4, 0, 0), None).unwrap();
        let mut b = [0u8; 64];
        small.read(4 * 64, &mut b);
        let c: Cqe64 = bytemuck::cast(b);
        assert_eq!(c.wqe_counter.get(), 4);
        assert!(sw_owns(c.op_own, 4, 16));
    }

    #[test]
    fn overrun_detect_and_collapsed() {
        let cq = Cq::new(
            2,
            CqConfig {
                ncqe: 2,
                mode: CqMode::OverrunDetect,
                ..Default::default()
            },
        )
        .unwrap();
        cq.push(Cqe64::requester(8, 1, 0, 0, 0), None).unwrap();
        cq.push(Cqe64::requester(8, 1, 1, 0, 0), None).unwrap();
        assert_eq!(
            cq.push(Cqe64::requester(8, 1, 2, 0, 0), None),
            Err(CqError::Overrun(2))
        );
        assert!(cq.is_overrun());

        let cq = Cq::new(
            3,
            CqConfig {
                ncqe: 2,
                mode: CqMode::OverrunDetect,
                ..Default::default()
            },
        )
        .unwrap();
        for i in 0..6u32 {
            cq.push(Cqe64::requester(8, 1, i as u16, 0, 0), None)
                .unwrap();
            cq.dbrec()
                .atomic_u32(0)
                .store((i + 1).to_be(), Ordering::Release);
        }

        let cq = Cq::new(
            4,
            CqConfig {
                ncqe: 1,
                mode: CqMode::Collapsed,
                ..Default::default()
            },
        )
        .unwrap();
        for i in 0..5u16 {
            cq.push(Cqe64::requester(8, 1, i, 0, 0), None).unwrap();
            assert_eq!(read(&cq, 0).wqe_counter.get(), i);
        }
        assert_eq!(cq.produced(), 5);
    }
}
