//! In-process WRITEs whose bytes move within one device memory: the engine queues their
//! copies (`DeviceMemory::copy_queued`) and writes their CQEs after one settle for the run
//! (one wait instead of one synchronous copy per WQE). No CQE is written before the settle
//! has returned, a failing settle never gives a success, anything that runs behind the run
//! (a READ) sees its bytes, and the batching holds as the SQ index wraps.

mod common;

use common::*;
use prm::wqe::{Local, Op, Opcode, Sge};
use prm::{Lkey, Rkey, Syndrome};
use softnic::devmem::{DeviceMemory, DeviceMemoryError, SimDeviceMemory};
use softnic::outcome::vendor;
use softnic::{Access, MrInfo, QpState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

const ALL: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// A device memory that really leaves queued copies queued (as a CUDA stream does) until
/// `settle` or any other call, and counts them; its settle can be held back (it blocks until
/// the test opens the gate) or made to fail (the queued copies are lost and every later call
/// fails, as a CUDA context does after an asynchronous fault).
struct Queuing {
    inner: Arc<SimDeviceMemory>,
    held: Mutex<Vec<(u64, u64, usize)>>,
    /// `copy_queued` calls.
    queued: AtomicU64,
    /// Synchronous `copy` calls.
    copies: AtomicU64,
    /// Settles that found copies queued.
    settles: AtomicU64,
    /// Settle calls of any kind.
    settle_calls: AtomicU64,
    /// Closed: a settle waits until it opens.
    gate: Mutex<bool>,
    opened: Condvar,
    fail_settle: AtomicBool,
    poisoned: AtomicBool,
}

impl Queuing {
    fn new(len: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: SimDeviceMemory::new(len),
            held: Mutex::new(Vec::new()),
            queued: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            settles: AtomicU64::new(0),
            settle_calls: AtomicU64::new(0),
            gate: Mutex::new(true),
            opened: Condvar::new(),
            fail_settle: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
        })
    }

    fn counts(&self) -> (u64, u64, u64) {
        (
            self.queued.load(Ordering::SeqCst),
            self.copies.load(Ordering::SeqCst),
            self.settles.load(Ordering::SeqCst),
        )
    }

    fn set_gate(&self, open: bool) {
        *self.gate.lock().unwrap() = open;
        self.opened.notify_all();
    }

    /// Completes the queued copies (a failing settle drops them instead).
    fn land(&self, settling: bool) -> Result<(), DeviceMemoryError> {
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(DeviceMemoryError("poisoned by a failed queued copy".into()));
        }
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        if held.is_empty() {
            return Ok(());
        }
        if settling {
            self.settles.fetch_add(1, Ordering::SeqCst);
        }
        if self.fail_settle.load(Ordering::SeqCst) {
            self.poisoned.store(true, Ordering::SeqCst);
            return Err(DeviceMemoryError("a queued copy failed".into()));
        }
        for (d, s, n) in held {
            let mut b = vec![0u8; n];
            self.inner.read(s, &mut b)?;
            self.inner.write(d, &b)?;
        }
        Ok(())
    }
}

impl DeviceMemory for Queuing {
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
        self.land(false)?;
        self.inner.read(src, dst)
    }
    fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        self.land(false)?;
        self.inner.write(dst, src)
    }
    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.copies.fetch_add(1, Ordering::SeqCst);
        self.land(false)?;
        self.inner.copy(dst, src, len)
    }
    fn copy_queued(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(DeviceMemoryError("poisoned by a failed queued copy".into()));
        }
        self.queued.fetch_add(1, Ordering::SeqCst);
        self.held.lock().unwrap().push((dst, src, len));
        Ok(())
    }
    fn settle(&self) -> Result<(), DeviceMemoryError> {
        self.settle_calls.fetch_add(1, Ordering::SeqCst);
        let mut open = self.gate.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        self.land(true)
    }
}

/// Opens the gate when dropped.
struct Opener(Arc<Queuing>);

impl Drop for Opener {
    fn drop(&mut self) {
        self.0.set_gate(true);
    }
}

/// A region of `mem` at offset `off`, registered on `n`.
struct Reg {
    mem: Arc<Queuing>,
    mr: MrInfo,
}

impl Reg {
    fn new(n: &Node, mem: &Arc<Queuing>, off: u64, len: usize) -> Self {
        let dm: Arc<dyn DeviceMemory> = mem.clone();
        let mr = n
            .dev
            .reg_device(n.pd, mem.inner.base() + off, len as u64, ALL, dm)
            .expect("register device memory");
        Self {
            mem: mem.clone(),
            mr,
        }
    }
    fn addr(&self, off: usize) -> u64 {
        self.mr.addr + off as u64
    }
    fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr(off),
            len,
            lkey: Lkey(self.mr.key),
        }
    }
    fn remote(&self, off: usize) -> prm::wqe::RemoteAddr {
        prm::wqe::RemoteAddr {
            addr: self.addr(off),
            rkey: Rkey(self.mr.key),
        }
    }
    /// The bytes in device memory (what has landed; not through the trait).
    fn peek(&self, off: usize, len: usize) -> Vec<u8> {
        self.mem.inner.peek(self.addr(off), len)
    }
    fn poke(&self, off: usize, b: &[u8]) {
        self.mem.inner.poke(self.addr(off), b)
    }
}

const MB: usize = 1 << 20;
const W: u8 = Opcode::RdmaWrite as u8;

/// A source region on A and a destination region on B, in one device memory.
fn setup(p: &Pair, mem: &Arc<Queuing>) -> (Reg, Reg) {
    let src = Reg::new(&p.a, mem, 0, 256 << 10);
    let dst = Reg::new(&p.b, mem, 512 << 10, 256 << 10);
    (src, dst)
}

/// Posts WRITE `i` of a run (a length and offset of its own) without a doorbell.
fn post_write(p: &mut Pair, src: &Reg, dst: &Reg, i: usize) -> (u16, usize, usize) {
    let (off, len) = (i * 2048 + i % 5, 500 + 13 * i);
    let op = Op::Write {
        remote: dst.remote(off),
        local: Local::Sges(&[src.sge(off, len as u32)]),
        imm: None,
    };
    (p.ea.post(&op, SIG), off, len)
}

/// `k` WRITEs announced by one doorbell between two in-process QPs on one device memory:
/// every copy queued, one settle per engine turn (64 WQEs), not a wait per WQE; every
/// completion in order and every byte where it belongs.
#[test]
fn writes_within_one_device_memory_take_one_settle() {
    for (k, settles) in [(40usize, 1u64), (100, 2)] {
        let mem = Queuing::new(MB);
        let big = Opts {
            sq_blocks: 256,
            ..Opts::default()
        };
        let mut p = Pair::with(big, Opts::default());
        let (src, dst) = setup(&p, &mem);
        let data = Rng(k as u64).bytes(256 << 10);
        src.poke(0, &data);
        let before = p.a.dev.counters();
        let posted: Vec<_> = (0..k).map(|i| post_write(&mut p, &src, &dst, i)).collect();
        p.ea.ini.ring();
        for &(idx, _, len) in &posted {
            assert_eq!(p.ea.expect_req(W, idx) as usize, len);
        }
        assert_eq!(
            mem.counts(),
            (k as u64, 0, settles),
            "{k} WRITEs: (queued copies, synchronous copies, settles)"
        );
        for &(_, off, len) in &posted {
            assert!(dst.peek(off, len) == data[off..off + len], "bytes at {off}");
        }
        let c = p.a.dev.counters();
        assert_eq!(c.local_copy_batches - before.local_copy_batches, settles);
        assert_eq!(c.local_copy_wqes - before.local_copy_wqes, k as u64);
        assert_eq!(c.device_memory_errors, 0);
        p.eb.expect_quiet(Duration::from_millis(10));
    }
}

/// While the settle is held back, no CQE of the run is visible and no byte has landed; once
/// it returns, every CQE comes with its bytes.
#[test]
fn no_completion_is_visible_before_the_settle_returns() {
    let mem = Queuing::new(MB);
    let mut p = Pair::new();
    let (src, dst) = setup(&p, &mem);
    let data = Rng(3).bytes(256 << 10);
    src.poke(0, &data);
    mem.set_gate(false);
    // opens the gate however the test ends, or the engine would never return from the settle
    let _open = Opener(mem.clone());
    let posted: Vec<_> = (0..10).map(|i| post_write(&mut p, &src, &dst, i)).collect();
    p.ea.ini.ring();
    wait_until("the engine settles", || {
        mem.settle_calls.load(Ordering::SeqCst) > 0
    });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        p.ea.ini.poll_send(),
        None,
        "a CQE before the settle returned"
    );
    for &(_, off, len) in &posted {
        assert!(dst.peek(off, len).iter().all(|&b| b == 0), "landed early");
    }
    mem.set_gate(true);
    for &(idx, off, len) in &posted {
        p.ea.expect_req(W, idx);
        assert!(dst.peek(off, len) == data[off..off + len], "bytes at {off}");
    }
    assert_eq!(mem.counts(), (10, 0, 1));
}

/// A settle that fails gives no success: the run's first WRITE completes with the
/// device-memory error (LOCAL_PROT, vendor DEVICE_MEMORY), the others flush, the requester is
/// in ERR and the responder is not affected.
#[test]
fn a_failing_settle_gives_an_error_never_a_success() {
    let mem = Queuing::new(MB);
    let mut p = Pair::new();
    let (src, dst) = setup(&p, &mem);
    src.poke(0, &Rng(4).bytes(256 << 10));
    mem.fail_settle.store(true, Ordering::SeqCst);
    let posted: Vec<_> = (0..8).map(|i| post_write(&mut p, &src, &dst, i)).collect();
    p.ea.ini.ring();
    p.ea.expect_err(Syndrome::LocalProt, vendor::DEVICE_MEMORY, W, posted[0].0);
    for &(idx, ..) in &posted[1..] {
        p.ea.expect_flush(W, idx);
    }
    p.ea.expect_quiet(Duration::from_millis(20));
    assert_eq!(p.ea.qp.state(), QpState::Err);
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    assert_eq!(p.a.dev.counters().device_memory_errors, 1);
    for &(_, off, len) in &posted {
        assert!(dst.peek(off, len).iter().all(|&b| b == 0), "bytes landed");
    }
}

/// A READ behind the WRITEs (same doorbell) ends the run: the WRITEs' CQEs come after one
/// settle, the READ runs after it and reads the bytes they wrote.
#[test]
fn a_read_behind_the_writes_sees_their_bytes() {
    let mem = Queuing::new(MB);
    let mut p = Pair::new();
    let (src, dst) = setup(&p, &mem);
    let back = p.a.buf(64 << 10, ALL);
    let data = Rng(5).bytes(256 << 10);
    src.poke(0, &data);
    let posted: Vec<_> = (0..6).map(|i| post_write(&mut p, &src, &dst, i)).collect();
    let (off, len) = (posted[5].1, posted[5].2);
    let read = Op::Read {
        remote: dst.remote(off),
        local: &[back.sge(0, len as u32)],
    };
    let ridx = p.ea.post(&read, SIG);
    p.ea.ini.ring();
    for &(idx, ..) in &posted {
        p.ea.expect_req(W, idx);
    }
    p.ea.expect_req(Opcode::RdmaRead as u8, ridx);
    assert!(back.read(0, len) == data[off..off + len], "READ bytes");
    assert_eq!(mem.counts(), (6, 0, 1));
}

/// Rounds of WRITEs through a 64-block ring until the 16-bit SQ index has wrapped: each
/// round one settle, every completion at its index, the bytes of every round in place.
#[test]
fn runs_across_the_sq_index_wrap() {
    let mem = Queuing::new(MB);
    let mut p = Pair::new();
    let (src, dst) = setup(&p, &mem);
    let data = Rng(6).bytes(256 << 10);
    src.poke(0, &data);
    let per = 48usize;
    let rounds = 65536 / per + 2;
    let mut wrapped = false;
    for r in 0..rounds {
        let mut posted = Vec::with_capacity(per);
        for i in 0..per {
            let off = ((r * per + i) % 100) * 2048;
            let op = Op::Write {
                remote: dst.remote(off + 1),
                local: Local::Sges(&[src.sge(off, 64 + (i as u32 % 7))]),
                imm: None,
            };
            let signaled = i % 8 == 7;
            posted.push((p.ea.post(&op, flags(signaled)), signaled));
        }
        wrapped |= posted.windows(2).any(|w| w[1].0 < w[0].0);
        p.ea.ini.ring();
        for &(idx, signaled) in &posted {
            if signaled {
                p.ea.expect_req(W, idx);
            }
        }
        assert_eq!(mem.counts().2, r as u64 + 1, "round {r}: settles");
    }
    assert!(wrapped, "the SQ index wrapped");
    assert_eq!(mem.counts().1, 0, "no synchronous copy");
    for j in 0..100 {
        let off = j * 2048;
        let got = dst.peek(off + 1, 64);
        // the last round that wrote slot j wrote at least 64 bytes of it
        assert!(got[..64] == data[off..off + 64], "slot {j}");
    }
}

/// A WRITE with immediate (it consumes a receive and completes one on the responder) ends the
/// run: the WRITEs before it complete after one settle, it copies synchronously, and the
/// WRITEs behind it make a run of their own; every completion in order, the receive's after
/// its bytes.
#[test]
fn a_write_with_immediate_ends_the_run() {
    let mem = Queuing::new(MB);
    let mut p = Pair::new();
    let (src, dst) = setup(&p, &mem);
    let data = Rng(7).bytes(256 << 10);
    src.poke(0, &data);
    p.eb.ini.post_recv(&[]).unwrap();
    let before: Vec<_> = (0..5).map(|i| post_write(&mut p, &src, &dst, i)).collect();
    let (ioff, ilen) = (100 * 2048, 3000);
    let imm = Op::Write {
        remote: dst.remote(ioff),
        local: Local::Sges(&[src.sge(ioff, ilen)]),
        imm: Some(0x1234),
    };
    let iidx = p.ea.post(&imm, SIG);
    let after: Vec<_> = (5..10).map(|i| post_write(&mut p, &src, &dst, i)).collect();
    p.ea.ini.ring();
    for &(idx, ..) in &before {
        p.ea.expect_req(W, idx);
    }
    p.ea.expect_req(Opcode::RdmaWriteImm as u8, iidx);
    for &(idx, ..) in &after {
        p.ea.expect_req(W, idx);
    }
    assert!(matches!(p.eb.recv_cqe(), prm::Completion::Resp { .. }));
    assert!(dst.peek(ioff, ilen as usize) == data[ioff..ioff + ilen as usize]);
    for &(_, off, len) in before.iter().chain(&after) {
        assert!(dst.peek(off, len) == data[off..off + len], "bytes at {off}");
    }
    assert_eq!(mem.counts(), (10, 1, 2), "(queued, synchronous, settles)");
}

/// WRITEs within two device memories, alternating, behind one doorbell: one run, each memory
/// settled once before any completion is written.
#[test]
fn a_run_over_two_memories_settles_each_once() {
    let (m1, m2) = (Queuing::new(MB), Queuing::new(MB));
    let mut p = Pair::new();
    let (s1, d1) = setup(&p, &m1);
    let (s2, d2) = setup(&p, &m2);
    let (x, y) = (Rng(8).bytes(256 << 10), Rng(9).bytes(256 << 10));
    s1.poke(0, &x);
    s2.poke(0, &y);
    let posted: Vec<_> = (0..20)
        .map(|i| match i % 2 {
            0 => (post_write(&mut p, &s1, &d1, i), true),
            _ => (post_write(&mut p, &s2, &d2, i), false),
        })
        .collect();
    p.ea.ini.ring();
    for &((idx, off, len), first) in &posted {
        p.ea.expect_req(W, idx);
        let (d, data) = if first { (&d1, &x) } else { (&d2, &y) };
        assert!(d.peek(off, len) == data[off..off + len], "bytes at {off}");
    }
    assert_eq!(m1.counts(), (10, 0, 1));
    assert_eq!(m2.counts(), (10, 0, 1));
    let c = p.a.dev.counters();
    assert_eq!((c.local_copy_batches, c.local_copy_wqes), (1, 20));
}

/// A WRITE whose bytes cannot be queued (here: into host memory, the signal word of a put
/// with signal) behind queued ones lands after them, as a NIC places a QP's WRITEs in order:
/// while their settle is held back, the signal is not there; once it returns, the signal and
/// every byte before it are.
#[test]
fn a_write_that_is_not_queued_lands_after_the_queued_ones() {
    let mem = Queuing::new(MB);
    let mut p = Pair::new();
    let (src, dst) = setup(&p, &mem);
    let data = Rng(9).bytes(256 << 10);
    src.poke(0, &data);
    let flag_src = p.a.buf(8, ALL);
    flag_src.mem.write(GUARD, &1u64.to_le_bytes());
    let flag = p.b.buf(8, ALL);
    mem.set_gate(false);
    let _open = Opener(mem.clone());
    let posted: Vec<_> = (0..6).map(|i| post_write(&mut p, &src, &dst, i)).collect();
    let signal = Op::Write {
        remote: flag.remote(0),
        local: Local::Sges(&[flag_src.sge(0, 8)]),
        imm: None,
    };
    let sig_idx = p.ea.post(&signal, SIG);
    p.ea.ini.ring();
    wait_until("the engine settles", || {
        mem.settle_calls.load(Ordering::SeqCst) > 0
    });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        flag.read(0, 8),
        [0u8; 8],
        "the signal landed before the WRITEs queued ahead of it"
    );
    assert_eq!(
        p.ea.ini.poll_send(),
        None,
        "a CQE before the settle returned"
    );
    mem.set_gate(true);
    for &(idx, ..) in &posted {
        p.ea.expect_req(W, idx);
    }
    p.ea.expect_req(W, sig_idx);
    assert_eq!(flag.read(0, 8), 1u64.to_le_bytes());
    for &(_, off, len) in &posted {
        assert!(dst.peek(off, len) == data[off..off + len], "bytes at {off}");
    }
    assert_eq!(mem.counts(), (6, 0, 1));
}
