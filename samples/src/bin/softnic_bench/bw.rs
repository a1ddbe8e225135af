//! The bandwidth measurement: large writes with `--depth` in flight, in alternating rounds with a
//! plain memcpy of the same bytes on this thread and on another ([`bandwidth`]), every
//! destination checked.

use super::args::Stop;
use super::loopback::{Loopback, SLOT};
use anyhow::{bail, Result};
use gpuverbs::post::{CtrlFlags, Lkey, Local, Op, RemoteAddr, Rkey, Sge};
use gpuverbs::soft::raw::DmaBuf;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 8-byte copies between the same kind of slots, for orientation.
pub(super) fn memcpy_rate(slots: usize, stop: Stop) -> f64 {
    let src = DmaBuf::alloc(slots * SLOT);
    let dst = DmaBuf::alloc(slots * SLOT);
    let len = black_box(SLOT);
    let (mut n, start) = (0u64, Instant::now());
    while !stop.done(start, n) {
        for i in 0..slots {
            // SAFETY: both slots lie inside buffers this function owns and no device uses.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    black_box(src.as_ptr().add(i * SLOT)),
                    dst.as_ptr().add(i * SLOT),
                    len,
                )
            };
        }
        n += slots as u64;
    }
    black_box(&dst);
    n as f64 / start.elapsed().as_secs_f64()
}

/// First 64-bit word of the pattern of round `k` (each round writes a new pattern).
pub(super) fn seed(k: u64) -> u64 {
    let mut z = k.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Writes pattern `k` (word i = seed(k) + i) into `len` bytes at `off`.
pub(super) fn fill(buf: &DmaBuf, off: usize, len: usize, k: u64) {
    assert!(off + len <= buf.len() && off % 8 == 0 && len % 8 == 0);
    let s = seed(k);
    // SAFETY: in bounds and aligned (checked above; the buffer is page-aligned); no WQE that
    // names this range is in flight while the benchmark fills it.
    let p = unsafe { buf.as_ptr().add(off) } as *mut u64;
    for i in 0..len / 8 {
        // SAFETY: i < len / 8, inside the checked range.
        unsafe { p.add(i).write(s.wrapping_add(i as u64)) };
    }
}

/// Checks that `len` bytes at `off` hold pattern `k`; returns the first bad word.
pub(super) fn verify(buf: &DmaBuf, off: usize, len: usize, k: u64) -> Option<(usize, u64, u64)> {
    assert!(off + len <= buf.len() && off % 8 == 0 && len % 8 == 0);
    let s = seed(k);
    // SAFETY: as in `fill`; the write that filled this range has completed (its CQE was
    // taken with acquire ordering) and no other is in flight.
    let p = unsafe { buf.as_ptr().add(off) } as *const u64;
    (0..len / 8).find_map(|i| {
        // SAFETY: i < len / 8, inside the checked range.
        let got = unsafe { p.add(i).read() };
        let want = s.wrapping_add(i as u64);
        (got != want).then_some((i * 8, got, want))
    })
}

pub(super) struct BwResult {
    pub(super) writes: u64,
    pub(super) size: usize,
    pub(super) engine: Duration,
    pub(super) memcpy: Duration,
    pub(super) memcpy_thread: Duration,
}

impl BwResult {
    pub(super) fn gbps(&self, d: Duration) -> f64 {
        (self.writes * self.size as u64) as f64 / d.as_secs_f64() / 1e9
    }
}

/// A thread that copies the benchmark's slots when told to: memcpy seen from another core, as
/// the engine thread sees the bytes the benchmark thread wrote. Like the engine, it spins a
/// little, then parks until woken, so it takes no CPU from the engine while idle.
pub(super) struct CopyThread {
    pub(super) sync: Arc<(AtomicU64, AtomicU64)>,
    pub(super) handle: Option<std::thread::JoinHandle<()>>,
}

impl CopyThread {
    /// # Safety
    /// `src` and `dst` must hold `depth * size` bytes and outlive the thread; the caller only
    /// touches them between a [`CopyThread::copy`] call's return and the next call.
    unsafe fn start(src: usize, dst: usize, size: usize, depth: usize) -> Self {
        let sync = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let s = sync.clone();
        let handle = std::thread::spawn(move || {
            let (go, done) = (&s.0, &s.1);
            let mut seen = 0;
            loop {
                let mut spins = 0u32;
                let g = loop {
                    let g = go.load(Ordering::Acquire);
                    if g != seen {
                        break g;
                    }
                    spins = spins.wrapping_add(1);
                    if spins > 4096 {
                        std::thread::park();
                    } else {
                        std::hint::spin_loop();
                    }
                };
                if g == u64::MAX {
                    return;
                }
                for i in 0..depth {
                    // SAFETY: per the contract of `start`: in bounds, live, not touched by the
                    // caller until `done` says so.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (src + i * size) as *const u8,
                            (dst + i * size) as *mut u8,
                            black_box(size),
                        )
                    };
                }
                seen = g;
                done.store(g, Ordering::Release);
            }
        });
        Self {
            sync,
            handle: Some(handle),
        }
    }

    pub(super) fn wake(&self) {
        if let Some(h) = &self.handle {
            h.thread().unpark();
        }
    }

    /// Has the thread copy every slot once; returns the time from the request to the end.
    pub(super) fn copy(&self, round: u64) -> Duration {
        let t = Instant::now();
        self.sync.0.store(round, Ordering::Release);
        self.wake();
        while self.sync.1.load(Ordering::Acquire) != round {
            std::hint::spin_loop();
        }
        t.elapsed()
    }
}

impl Drop for CopyThread {
    fn drop(&mut self) {
        self.sync.0.store(u64::MAX, Ordering::Release);
        self.wake();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Fills every slot with a new pattern, runs `copy` (timed), then checks every slot.
pub(super) fn round(
    lb: &mut Loopback,
    size: usize,
    depth: usize,
    k: &mut u64,
    what: &str,
    copy: impl FnOnce(&mut Loopback) -> Result<Duration>,
) -> Result<Duration> {
    for i in 0..depth {
        fill(&lb.src, i * size, size, *k + i as u64);
    }
    let took = copy(lb)?;
    for i in 0..depth {
        if let Some((at, got, want)) = verify(&lb.dst, i * size, size, *k + i as u64) {
            bail!(
                "{what}, pattern {}: slot {i} byte {at} holds {got:#x}, expected {want:#x}",
                *k + i as u64
            );
        }
    }
    *k += depth as u64;
    Ok(took)
}

/// Rounds of `depth` writes of `size` bytes (slot i of the source to slot i of the
/// destination), each followed by a round of plain memcpy over the same buffers on this thread
/// and one on another thread. Only the transfers are timed; the fills (a new pattern each
/// round) and the checks are not.
pub(super) fn bandwidth(
    lb: &mut Loopback,
    size: usize,
    depth: usize,
    stop: Stop,
    k: &mut u64,
) -> Result<BwResult> {
    let start = Instant::now();
    let mut r = BwResult {
        writes: 0,
        size,
        engine: Duration::ZERO,
        memcpy: Duration::ZERO,
        memcpy_thread: Duration::ZERO,
    };
    let (src, dst) = (lb.src.as_ptr() as usize, lb.dst.as_ptr() as usize);
    // SAFETY: the buffers hold depth * size bytes (allocated so), outlive `copier` (dropped at
    // the end of this function) and are only touched between its copies.
    let copier = unsafe { CopyThread::start(src, dst, size, depth) };
    let mut copies = 0u64;
    while !stop.done(start, r.writes) {
        r.engine += round(lb, size, depth, k, "RDMA_WRITE", |lb| {
            let t = Instant::now();
            for i in 0..depth {
                let op = Op::Write {
                    remote: RemoteAddr {
                        addr: lb.dst.addr() + (i * size) as u64,
                        rkey: Rkey(lb.dst_mr.key),
                    },
                    local: Local::Sges(&[Sge {
                        addr: lb.src.addr() + (i * size) as u64,
                        len: size as u32,
                        lkey: Lkey(lb.src_mr.key),
                    }]),
                    imm: None,
                };
                lb.ini.post(&op, CtrlFlags::SIGNALED)?;
            }
            lb.ini.ring();
            for _ in 0..depth {
                lb.wait()?;
            }
            Ok(t.elapsed())
        })?;
        r.memcpy += round(lb, size, depth, k, "memcpy", |_| {
            let t = Instant::now();
            for i in 0..depth {
                // SAFETY: both slots are inside the buffers and no WQE is in flight.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (src + i * size) as *const u8,
                        (dst + i * size) as *mut u8,
                        black_box(size),
                    )
                };
            }
            Ok(t.elapsed())
        })?;
        r.memcpy_thread += round(lb, size, depth, k, "memcpy (other thread)", |_| {
            copies += 1;
            Ok(copier.copy(copies))
        })?;
        r.writes += depth as u64;
    }
    Ok(r)
}

/// The 8-byte memcpy reference runs a quarter of the time (it only orients).
pub(super) fn measure_memcpy(s: Stop) -> Stop {
    match s {
        Stop::After(d) => Stop::After(d / 4),
        Stop::Count(n) => Stop::Count(n),
    }
}
