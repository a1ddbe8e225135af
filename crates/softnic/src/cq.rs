//! Completion queues: a ring of 64-byte CQEs with per-lap owner bits, written the way a ConnectX
//! writes them (bytes 0..60, then the last 4 bytes released with one store).
//!
//! The ring may be host memory or device memory ([`DmaBuf::from_device`]); in device memory the
//! two parts are two ordered writes through its [`crate::DeviceMemory`], and a write that fails
//! puts the CQ in error for good (as a ConnectX's CQ error after a PCIe fault). The CQ doorbell
//! record is always host memory.

use crate::buffer::DmaBuf;
use crate::event::{AsyncEvent, EventHandler, EventSlot};
use prm::cqe::{owner_bit, Cqe64, CQE_TAIL_OFFSET, OP_OWN_INVALID, OP_OWN_INVALID_OWNED};
use prm::CQE_SIZE;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `op_own` of the CQE a resize writes into the old ring (opcode `MLX5_CQE_RESIZE_CQ`).
pub const RESIZE_OP_OWN: u8 = 5 << 4;

/// How the device treats the consumer index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqMode {
    /// The device never reads the consumer index (what GPU stacks use).
    #[default]
    OverrunIgnore,
    /// The device reads the consumer index from the CQ doorbell record; a CQE that would
    /// overwrite an entry not yet consumed puts the CQ in error (CQ overrun).
    OverrunDetect,
    /// Every CQE lands in slot 0 (the newest completion overwrites the last).
    Collapsed,
}

/// The byte a fresh ring is filled with at `op_own`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqInit {
    /// `0xF0`, as the mlx5 provider initialises.
    #[default]
    Invalid,
    /// `0xF1`, as DOCA pre-fills.
    InvalidOwned,
    /// Left as the consumer wrote it: a ConnectX writes a CQ ring only with CQEs, and a CQ
    /// created with a PRM command (DEVX) lives in memory its owner prepared.
    Untouched,
}

/// Parameters of a new CQ.
#[derive(Debug, Default)]
pub struct CqConfig {
    /// Number of CQEs (power of two).
    pub ncqe: u32,
    /// Consumer-index mode.
    pub mode: CqMode,
    /// Initial `op_own`.
    pub init: CqInit,
    /// Ring memory (at least `ncqe * 64` bytes), host or device memory; allocated in host
    /// memory when `None`.
    pub ring: Option<DmaBuf>,
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
}

struct CqState {
    /// CQEs produced so far (the producer index).
    pi: u32,
    /// The ring the CQ writes into after [`Cq::resize`] (the creation ring when `None`).
    resized: Option<DmaBuf>,
    overrun: bool,
    failed: bool,
    delayed: VecDeque<(Instant, Cqe64)>,
}

/// Prepares the first `ncqe` entries of a CQ ring as `init` says: an invalid CQE with the
/// `op_own` it names in each (host or device memory), or nothing for [`CqInit::Untouched`].
pub fn prefill(ring: &DmaBuf, ncqe: usize, init: CqInit) -> Result<(), crate::Error> {
    let fill = match init {
        CqInit::Invalid => OP_OWN_INVALID,
        CqInit::InvalidOwned => OP_OWN_INVALID_OWNED,
        CqInit::Untouched => return Ok(()),
    };
    let bytes = ncqe * CQE_SIZE;
    if ring.len() < bytes {
        return Err(crate::Error::InvalidArgument(
            "CQ ring memory smaller than ncqe * 64",
        ));
    }
    let entry = Cqe64::invalid(fill);
    if ring.is_host() {
        for i in 0..ncqe {
            ring.write(i * CQE_SIZE, bytemuck::bytes_of(&entry));
        }
    } else {
        // device memory: as few writes as the bounce size allows (one for rings ≤ 1 MiB)
        let chunk = bytes.min(crate::devmem::BOUNCE);
        let mut fill = Vec::with_capacity(chunk);
        while fill.len() < chunk {
            fill.extend_from_slice(bytemuck::bytes_of(&entry));
        }
        for off in (0..bytes).step_by(chunk) {
            ring.try_write(off, &fill[..chunk.min(bytes - off)])?;
        }
    }
    Ok(())
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
    pub(crate) events: EventSlot,
}

impl Cq {
    pub(crate) fn new(cqn: u32, cfg: CqConfig) -> Result<Self, crate::Error> {
        if cfg.ncqe == 0 || !cfg.ncqe.is_power_of_two() || cfg.ncqe > 1 << 22 {
            return Err(crate::Error::InvalidArgument(
                "CQ size must be a power of two ≤ 2^22",
            ));
        }
        let bytes = cfg.ncqe as usize * CQE_SIZE;
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
                    "CQ ring memory smaller than ncqe * 64",
                ))
            }
            Some(r) => r,
            None => DmaBuf::alloc(bytes),
        };
        prefill(&ring, cfg.ncqe as usize, cfg.init)?;
        Ok(Self {
            cqn,
            ncqe: AtomicU32::new(cfg.ncqe),
            mode: cfg.mode,
            ring,
            dbrec,
            events: EventSlot::default(),
            state: Mutex::new(CqState {
                pi: 0,
                resized: None,
                overrun: false,
                failed: false,
                delayed: VecDeque::new(),
            }),
            produced: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            waiting: parking_lot::Mutex::new(()),
            written: parking_lot::Condvar::new(),
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
        if ncqe < 2 || !ncqe.is_power_of_two() || ncqe > 1 << 22 {
            return Err(crate::Error::InvalidArgument(
                "CQ size must be a power of two in 2..=2^22",
            ));
        }
        if ring.len() < ncqe as usize * CQE_SIZE {
            return Err(crate::Error::InvalidArgument(
                "CQ ring memory smaller than ncqe * 64",
            ));
        }
        if self.mode == CqMode::Collapsed {
            return Err(crate::Error::InvalidArgument(
                "a collapsed CQ is not resized",
            ));
        }
        let mut st = self.lock();
        if st.overrun || st.failed {
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

    fn write_locked(&self, st: &mut CqState, mut cqe: Cqe64) -> Result<(), CqError> {
        if st.overrun {
            return Err(CqError::Overrun(self.cqn));
        }
        if st.failed {
            return Err(CqError::Failed(self.cqn));
        }
        if self.mode == CqMode::OverrunDetect {
            // the consumer index, from a record in host memory or (a copy) in device memory
            let ci = match self.dbrec.load_u32_acquire(0) {
                Ok(w) => u32::from_be(w) & 0xff_ffff,
                Err(_) => {
                    st.failed = true;
                    self.events.raise(AsyncEvent::CqError);
                    return Err(CqError::DeviceMemory(self.cqn));
                }
            };
            if st.pi.wrapping_sub(ci) & 0xff_ffff >= self.ncqe() {
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
        cqe.op_own = (cqe.op_own & !1) | owner_bit(st.pi, ncqe);
        let (head, tail) = cqe.split_for_release();
        let off = slot * CQE_SIZE;
        // Two ordered writes: a consumer that sees the tail (acquire) sees the head.
        let ring = st.resized.as_ref().unwrap_or(&self.ring);
        let written = ring
            .try_write(off, &head)
            .and_then(|()| ring.store_u32_release(off + CQE_TAIL_OFFSET, tail));
        if let Err(e) = written {
            tracing::warn!(cqn = self.cqn, error = %e, "CQE write failed: CQ in error");
            st.failed = true;
            self.events.raise(AsyncEvent::CqError);
            return Err(CqError::DeviceMemory(self.cqn));
        }
        st.pi = st.pi.wrapping_add(1);
        // SeqCst: a waiter that registers after this sees the new count, or is seen here
        self.produced.store(st.pi, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.waiting.lock();
            self.written.notify_all();
        }
        Ok(())
    }
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
