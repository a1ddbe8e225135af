//! Soft NIC benchmark: CPU-initiated loopback between two soft QPs on two soft devices, host
//! memory.
//!
//! Measures, in one run:
//! - `write_rate`: 8-byte RDMA_WRITE message rate with the SQ kept full, `--batch` WQEs per
//!   doorbell and one signaled WQE in `--signal` (the initiator and the engine run at once);
//! - `write_rate_burst`: the same WQEs, but the whole SQ is written first and announced with one
//!   doorbell, so the time is the engine's alone;
//! - `write_bw`: `--size` (1 MiB) RDMA_WRITE bandwidth with `--depth` writes in flight, next to a
//!   plain memcpy of the same bytes between the same buffers (on this thread, and on another
//!   thread that sleeps between rounds as the engine does), measured in alternating rounds;
//! - `write_latency`: doorbell-to-CQE time of single 8-byte writes with the engine spinning,
//!   asleep and woken by the initiator, and asleep and finding the doorbell by polling (as it
//!   finds a GPU's).
//!
//! Each measurement also reports how much CPU other processes took meanwhile
//! (`other_cpu_cores`): on a 2-core machine the benchmark needs both cores.
//!
//! Every transfer is checked: each signaled completion must name the expected WQE and its
//! destination must hold that WQE's value; at the end every destination slot must hold its last
//! write; every bandwidth destination must hold the pattern of its round (a new one per round).
//! An error CQE aborts the run with the decoded error.
//!
//! `softnic_bench [--ring rdma-core|doca|bf] [--batch N] [--signal N] [--seconds S | --iters N]
//! [--inline] [--tests rate,burst,bw,latency] [--json]`

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use gpuverbs_samples::CpuSample;
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, Lkey, Rkey, Syndrome};
use serde_json::json;
use softnic::initiator::{CqGeometry, Initiator, RingMode, RqGeometry, SqGeometry};
use softnic::{
    Access, CounterSnapshot, Cq, CqConfig, CqMode, Device, DeviceConfig, DmaBuf, DoorbellKind,
    Fault, Modify, MrInfo, Qp, QpConfig, RtrAttr, RtsAttr,
};
use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The target for 8-byte writes, per engine thread.
const TARGET_MSGS_PER_S: f64 = 2.0e6;
/// The target for 1 MiB writes, as a fraction of memcpy.
const TARGET_BW_RATIO: f64 = 0.5;
/// Longest wait for a completion before the run is declared stuck.
const STUCK: Duration = Duration::from_secs(5);
/// Bytes per message-rate slot.
const SLOT: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Ring {
    /// DBREC, then the first 8 bytes of the last WQE to the register (alternating halves).
    RdmaCore,
    /// DBREC, then {BE32(pi << 8), BE32(qpn << 8)} to the register.
    Doca,
    /// DBREC, then the whole last WQE into the BlueFlame register.
    Bf,
}

impl Ring {
    fn mode(self) -> RingMode {
        match self {
            Ring::RdmaCore => RingMode::RdmaCore,
            Ring::Doca => RingMode::Doca,
            Ring::Bf => RingMode::BlueFlame,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Ring::RdmaCore => "rdma-core",
            Ring::Doca => "doca",
            Ring::Bf => "bf",
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Soft NIC loopback benchmark (CPU initiator, host memory)")]
struct Args {
    /// Doorbell convention of the initiator.
    #[arg(long, value_enum, default_value_t = Ring::RdmaCore)]
    ring: Ring,
    /// WQEs posted per doorbell in the message-rate test.
    #[arg(long, default_value_t = 32)]
    batch: u32,
    /// One WQE in this many asks for a CQE (selective signaling).
    #[arg(long, default_value_t = 64)]
    signal: u32,
    /// SQ size in 64-byte blocks (one 8-byte write WQE is one block).
    #[arg(long, default_value_t = 1024)]
    sq_blocks: u32,
    /// Carry the 8-byte payload inline in the WQE instead of gathering it through an lkey.
    #[arg(long)]
    inline: bool,
    /// Message size of the bandwidth test.
    #[arg(long, default_value_t = 1 << 20)]
    size: usize,
    /// Bandwidth-test writes in flight per round.
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Wall-clock seconds per measurement (warm-up and checks not counted in the result).
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Timed operations per measurement instead of a duration (messages, or bandwidth writes).
    #[arg(long)]
    iters: Option<u64>,
    /// Warm-up seconds before each measurement.
    #[arg(long, default_value_t = 0.3)]
    warmup: f64,
    /// Which measurements to run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![Test::Rate, Test::Burst, Test::Bw, Test::Latency])]
    tests: Vec<Test>,
    /// Samples per latency measurement.
    #[arg(long, default_value_t = 200)]
    latency_samples: usize,
    /// One JSON object per measurement on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// Make the first WQE of each test fail (fault injection), to show the abort path.
    #[arg(long)]
    inject_fault: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Test {
    /// 8-byte write rate, SQ kept full.
    Rate,
    /// 8-byte write rate, SQ written first and rung once (engine only).
    Burst,
    /// Large-write bandwidth next to memcpy.
    Bw,
    /// Doorbell-to-CQE time of single 8-byte writes: engine spinning, engine asleep and woken
    /// by the initiator, engine asleep and finding the doorbell by polling (as a GPU's).
    Latency,
    /// CPU time of idle soft NICs (connected QPs, no traffic), per engine thread.
    Idle,
}

impl std::fmt::Display for Test {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Test::Rate => "rate",
            Test::Burst => "burst",
            Test::Bw => "bw",
            Test::Latency => "latency",
            Test::Idle => "idle",
        })
    }
}

/// When a measurement stops: after a duration or a number of operations.
#[derive(Clone, Copy)]
enum Stop {
    After(Duration),
    Count(u64),
}

impl Stop {
    fn done(self, start: Instant, ops: u64) -> bool {
        match self {
            Stop::After(d) => start.elapsed() >= d,
            Stop::Count(n) => ops >= n,
        }
    }
}

/// Two soft devices, one RC connection A → B, and an initiator on A's QP.
struct Loopback {
    // Field order is drop order: the initiator and QPs go before the devices, and the buffers
    // are dropped last (after the devices' engines have stopped).
    ini: Initiator,
    qa: Arc<Qp>,
    a: Device,
    b: Device,
    src_mr: MrInfo,
    dst_mr: MrInfo,
    src: DmaBuf,
    dst: DmaBuf,
}

impl Loopback {
    /// `kick`: the initiator wakes the engine after each doorbell (as a CPU can); without it the
    /// engine finds doorbells by polling alone, as it finds a GPU's.
    fn new(args: &Args, ring: Ring, buf_len: usize, kick: bool) -> Result<Self> {
        let a = Device::open(DeviceConfig::default()).context("open device A")?;
        let b = Device::open(DeviceConfig::default()).context("open device B")?;
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let doorbell = if ring == Ring::Bf {
            DoorbellKind::BlueFlame
        } else {
            DoorbellKind::Register
        };
        let mk = |d: &Device, pd| -> Result<Arc<Qp>> {
            // One CQE per SQ block at most: the CQ can never overrun.
            let cq = d.create_cq(CqConfig {
                ncqe: args.sq_blocks.max(64),
                ..Default::default()
            })?;
            let mut cfg = QpConfig::new(pd, cq.clone(), cq);
            cfg.sq_blocks = args.sq_blocks;
            cfg.rq_wqes = 0;
            cfg.doorbell = doorbell;
            Ok(d.create_qp(cfg)?)
        };
        let (qa, qb) = (mk(&a, pa)?, mk(&b, pb)?);
        let src = DmaBuf::alloc(buf_len);
        let dst = DmaBuf::alloc(buf_len);
        // SAFETY: both buffers are owned by the returned value and outlive the devices (field
        // order above); nothing else writes them while WQEs that name them are in flight.
        let (src_mr, dst_mr) = unsafe {
            (
                a.reg_host(pa, src.addr(), src.len() as u64, Access::NONE)?,
                b.reg_host(
                    pb,
                    dst.addr(),
                    dst.len() as u64,
                    Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                )?,
            )
        };
        for (q, peer, dev) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
            q.modify(Modify::Init {
                access: Access::REMOTE_WRITE,
            })?;
            q.modify(Modify::Rtr(RtrAttr {
                remote_gid: dev.gid(),
                remote_qpn: peer.qpn(),
                rq_psn: 0,
                mtu: 4096,
                min_rnr_timer: 1,
                selective_repeat: false,
            }))?;
            q.modify(Modify::Rts(RtsAttr::default()))?;
        }
        if args.inject_fault {
            qa.inject(Fault::FailNext {
                count: 1,
                syndrome: Syndrome::RemoteAccess,
            });
        }
        let ini = if kick {
            Initiator::for_soft_qp(&a, &qa, ring.mode())
        } else {
            silent_initiator(&qa, ring.mode())
        };
        Ok(Self {
            ini,
            qa,
            a,
            b,
            src_mr,
            dst_mr,
            src,
            dst,
        })
    }

    /// Takes one send completion; `Ok(None)` when none is there. Any error CQE aborts.
    fn poll(&mut self) -> Result<Option<u16>> {
        match self.ini.poll_send() {
            None => Ok(None),
            Some(Completion::Req {
                wqe_opcode,
                wqe_counter,
                ..
            }) if wqe_opcode == prm::Opcode::RdmaWrite as u8 => Ok(Some(wqe_counter)),
            Some(Completion::Error(e)) => bail!("error CQE: {e}"),
            Some(other) => bail!("unexpected completion on the send CQ: {other:?}"),
        }
    }

    /// Waits for one send completion, at most [`STUCK`].
    fn wait(&mut self) -> Result<u16> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(w) = self.poll()? {
                return Ok(w);
            }
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 && start.elapsed() > STUCK {
                bail!(
                    "no completion within {STUCK:?} (QP {:?}, {} blocks outstanding); counters A: {:?}",
                    self.qa.state(),
                    self.ini.outstanding(),
                    self.a.counters()
                );
            }
            std::hint::spin_loop();
        }
    }

    fn counters(&self) -> CounterSnapshot {
        self.a.counters()
    }

    fn check_clean(&self) -> Result<()> {
        for (name, d) in [("A", &self.a), ("B", &self.b)] {
            let c = d.counters();
            if !c.errors.is_empty() || c.bad_doorbells != 0 || c.stale_wqes != 0 {
                bail!("device {name} counted errors: {c:?}");
            }
        }
        Ok(())
    }
}

/// An initiator for `qp` that never wakes the engine: its doorbells are noticed by the engine's
/// polling alone, as a GPU's are. The same geometry as `Initiator::for_soft_qp`, without `wake`.
fn silent_initiator(qp: &Arc<Qp>, mode: RingMode) -> Initiator {
    let cq_geom = |cq: &Cq| CqGeometry {
        ring: cq.ring().as_ptr(),
        ncqe: cq.ncqe(),
        dbrec: cq.dbrec().as_ptr(),
        collapsed: cq.mode() == CqMode::Collapsed,
    };
    let ctrl = qp.ctrl_page().as_ptr();
    // SAFETY: both offsets lie inside the QP's own control and UAR pages.
    let (dbrec, bf_reg) = unsafe {
        (
            ctrl.add(qp.dbrec_offset()),
            qp.uar().as_ptr().add(prm::doorbell::BF_OFFSET),
        )
    };
    let sq = SqGeometry {
        ring: qp.sq_ring().as_ptr(),
        blocks: qp.sq_blocks(),
        dbrec,
        bf_reg,
        qpn: qp.qpn(),
    };
    let rq = RqGeometry {
        ring: qp.rq_ring().as_ptr(),
        wqes: qp.rq_wqes(),
        stride: qp.rq_stride(),
        dbrec,
    };
    // SAFETY: every pointer is into memory owned by `qp` or its CQs, kept alive by the clone of
    // `qp` handed over; this initiator is the QP's only client.
    unsafe {
        Initiator::from_geometry(
            sq,
            rq,
            cq_geom(qp.send_cq()),
            cq_geom(qp.recv_cq()),
            mode,
            qp.clone(),
            None,
        )
    }
}

/// The 8-byte value message `n` writes (never 0, so an unwritten slot cannot pass).
fn value(n: u64) -> u64 {
    n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

fn read_u64(buf: &DmaBuf, off: usize) -> u64 {
    let mut b = [0u8; 8];
    buf.read(off, &mut b);
    u64::from_ne_bytes(b)
}

/// Result of a message-rate measurement.
struct RateResult {
    msgs: u64,
    secs: f64,
    doorbells: u64,
    /// Time the initiator spent writing WQEs and ringing, per message.
    post_ns_per_msg: f64,
}

impl RateResult {
    fn rate(&self) -> f64 {
        self.msgs as f64 / self.secs
    }
}

/// 8-byte writes: message `n` goes from source slot `n % slots` to destination slot
/// `n % slots`; a slot is reused only after the WQE that used it was retired by a CQE.
struct RateRun<'a> {
    lb: &'a mut Loopback,
    slots: u64,
    signal: u64,
    inline: bool,
    /// Next message number.
    next: u64,
    /// Messages retired by completions.
    retired: u64,
    /// Signaled messages not yet completed, oldest first.
    signaled: VecDeque<u64>,
    post_time: Duration,
}

impl<'a> RateRun<'a> {
    fn new(lb: &'a mut Loopback, args: &Args) -> Self {
        Self {
            slots: args.sq_blocks as u64,
            signal: args.signal.max(1) as u64,
            inline: args.inline,
            next: 0,
            retired: 0,
            signaled: VecDeque::new(),
            post_time: Duration::ZERO,
            lb,
        }
    }

    /// Writes message `next` into the SQ (no doorbell).
    fn post_one(&mut self, force_signal: bool) -> Result<()> {
        let n = self.next;
        let slot = (n % self.slots) as usize * SLOT;
        let v = value(n);
        let signaled = force_signal || n % self.signal == self.signal - 1;
        let payload = v.to_ne_bytes();
        let remote = RemoteAddr {
            addr: self.lb.dst.addr() + slot as u64,
            rkey: Rkey(self.lb.dst_mr.key),
        };
        let sge = [Sge {
            addr: self.lb.src.addr() + slot as u64,
            len: SLOT as u32,
            lkey: Lkey(self.lb.src_mr.key),
        }];
        let local = if self.inline {
            Local::Inline(&payload)
        } else {
            self.lb.src.write(slot, &payload);
            Local::Sges(&sge)
        };
        let flags = CtrlFlags {
            signaled,
            ..Default::default()
        };
        let idx = self
            .lb
            .ini
            .post(
                &Op::Write {
                    remote,
                    local,
                    imm: None,
                },
                flags,
            )
            .with_context(|| format!("post message {n}"))?;
        debug_assert_eq!(idx, n as u16);
        if signaled {
            self.signaled.push_back(n);
        }
        self.next += 1;
        Ok(())
    }

    /// Handles one completion: it must name the oldest signaled message, whose destination
    /// must hold its value; every message up to it is retired.
    fn complete(&mut self, wqe_counter: u16) -> Result<()> {
        let Some(n) = self.signaled.pop_front() else {
            bail!("completion for WQE {wqe_counter} but no signaled WQE outstanding");
        };
        if wqe_counter != n as u16 {
            bail!("completion names WQE {wqe_counter}, expected {}", n as u16);
        }
        let got = read_u64(&self.lb.dst, (n % self.slots) as usize * SLOT);
        if got != value(n) {
            bail!(
                "message {n}: destination slot holds {got:#x}, expected {:#x}",
                value(n)
            );
        }
        self.retired = n + 1;
        Ok(())
    }

    fn poll_all(&mut self) -> Result<()> {
        while let Some(w) = self.lb.poll()? {
            self.complete(w)?;
        }
        Ok(())
    }

    /// Posts a signaled last write and waits until everything is retired.
    fn drain(&mut self) -> Result<()> {
        if self.retired < self.next || self.next == 0 {
            if self.lb.ini.outstanding() >= self.slots as u32 {
                let w = self.lb.wait()?;
                self.complete(w)?;
            }
            self.post_one(true)?;
            self.lb.ini.ring();
        }
        while self.retired < self.next {
            let w = self.lb.wait()?;
            self.complete(w)?;
        }
        Ok(())
    }

    /// Every destination slot holds the last value written to it.
    fn check_all_slots(&self) -> Result<()> {
        let first = self.next.saturating_sub(self.slots);
        for n in first..self.next {
            let got = read_u64(&self.lb.dst, (n % self.slots) as usize * SLOT);
            if got != value(n) {
                bail!(
                    "final check: message {n}'s slot holds {got:#x}, expected {:#x}",
                    value(n)
                );
            }
        }
        Ok(())
    }

    /// One signaled write, rung alone; returns the time from the doorbell to its CQE.
    fn one(&mut self) -> Result<Duration> {
        self.post_one(true)?;
        let t = Instant::now();
        self.lb.ini.ring();
        let w = self.lb.wait()?;
        let took = t.elapsed();
        self.complete(w)?;
        Ok(took)
    }

    /// Keeps the SQ full for `stop`: poll, then post batches of `batch` and ring.
    fn steady(&mut self, batch: u32, stop: Stop) -> Result<RateResult> {
        let start = Instant::now();
        let first = self.retired;
        let doorbells0 = self.lb.counters().doorbells_seen;
        let post0 = self.post_time;
        let mut last_progress = Instant::now();
        let mut loops = 0u32;
        loop {
            let before = self.retired;
            self.poll_all()?;
            if self.retired != before {
                last_progress = Instant::now();
            }
            let free = self.slots as u32 - self.lb.ini.outstanding();
            if free >= batch {
                let t = Instant::now();
                for _ in 0..batch {
                    self.post_one(false)?;
                }
                self.lb.ini.ring();
                self.post_time += t.elapsed();
            } else {
                std::hint::spin_loop();
                loops = loops.wrapping_add(1);
                if loops % 4096 == 0 && last_progress.elapsed() > STUCK {
                    bail!(
                        "no progress for {STUCK:?} (QP {:?}); counters A: {:?}",
                        self.lb.qa.state(),
                        self.lb.counters()
                    );
                }
            }
            if stop.done(start, self.retired - first) {
                break;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let msgs = self.retired - first;
        Ok(RateResult {
            msgs,
            secs,
            doorbells: self.lb.counters().doorbells_seen - doorbells0,
            post_ns_per_msg: (self.post_time - post0).as_nanos() as f64 / msgs.max(1) as f64,
        })
    }

    /// Fills the whole SQ, then rings once and times until the last completion; repeats.
    fn bursts(&mut self, stop: Stop) -> Result<RateResult> {
        let start = Instant::now();
        let doorbells0 = self.lb.counters().doorbells_seen;
        let (mut msgs, mut timed, mut post) = (0u64, Duration::ZERO, Duration::ZERO);
        while !stop.done(start, msgs) {
            self.drain()?;
            let t = Instant::now();
            for i in 0..self.slots {
                self.post_one(i == self.slots - 1)?;
            }
            post += t.elapsed();
            let t = Instant::now();
            self.lb.ini.ring();
            while self.retired < self.next {
                let w = self.lb.wait()?;
                self.complete(w)?;
            }
            timed += t.elapsed();
            msgs += self.slots;
        }
        Ok(RateResult {
            msgs,
            secs: timed.as_secs_f64(),
            doorbells: self.lb.counters().doorbells_seen - doorbells0,
            post_ns_per_msg: post.as_nanos() as f64 / msgs.max(1) as f64,
        })
    }
}

/// Doorbell-to-CQE times (µs, sorted) of single 8-byte writes, each after `gap` (plus up to
/// 0.5 ms of jitter) of idleness, so that with a gap the engine has gone to sleep.
fn latency(lb: &mut Loopback, args: &Args, gap: Duration, samples: usize) -> Result<Vec<f64>> {
    const WARM: usize = 10;
    let mut run = RateRun::new(lb, args);
    let mut us = Vec::with_capacity(samples);
    for i in 0..samples + WARM {
        if !gap.is_zero() {
            std::thread::sleep(gap + Duration::from_micros((i as u64 * 7919) % 500));
        }
        let took = run.one()?;
        if i >= WARM {
            us.push(took.as_secs_f64() * 1e6);
        }
    }
    run.check_all_slots()?;
    us.sort_by(|a, b| a.total_cmp(b));
    Ok(us)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// 8-byte copies between the same kind of slots, for orientation.
fn memcpy_rate(slots: usize, stop: Stop) -> f64 {
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
fn seed(k: u64) -> u64 {
    let mut z = k.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Writes pattern `k` (word i = seed(k) + i) into `len` bytes at `off`.
fn fill(buf: &DmaBuf, off: usize, len: usize, k: u64) {
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
fn verify(buf: &DmaBuf, off: usize, len: usize, k: u64) -> Option<(usize, u64, u64)> {
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

struct BwResult {
    writes: u64,
    size: usize,
    engine: Duration,
    memcpy: Duration,
    memcpy_thread: Duration,
}

impl BwResult {
    fn gbps(&self, d: Duration) -> f64 {
        (self.writes * self.size as u64) as f64 / d.as_secs_f64() / 1e9
    }
}

/// A thread that copies the benchmark's slots when told to: memcpy seen from another core, as
/// the engine thread sees the bytes the benchmark thread wrote. Like the engine, it spins a
/// little, then parks until woken, so it takes no CPU from the engine while idle.
struct CopyThread {
    sync: Arc<(AtomicU64, AtomicU64)>,
    handle: Option<std::thread::JoinHandle<()>>,
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

    fn wake(&self) {
        if let Some(h) = &self.handle {
            h.thread().unpark();
        }
    }

    /// Has the thread copy every slot once; returns the time from the request to the end.
    fn copy(&self, round: u64) -> Duration {
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
fn round(
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
fn bandwidth(
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

fn human_rate(r: f64) -> String {
    if r >= 1e9 {
        format!("{:.2} G", r / 1e9)
    } else {
        format!("{:.2} M", r / 1e6)
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.sq_blocks < 2 || !args.sq_blocks.is_power_of_two() {
        bail!("--sq-blocks must be a power of two ≥ 2");
    }
    if args.batch == 0 || args.batch > args.sq_blocks {
        bail!("--batch must be 1..=sq_blocks");
    }
    // A full SQ (more than sq_blocks - batch blocks outstanding) must hold a signaled WQE.
    if args.signal == 0 || args.signal > args.sq_blocks - args.batch + 1 {
        bail!("--signal must be 1..=sq_blocks - batch + 1");
    }
    if args.size == 0 || args.size % 8 != 0 || args.size > 1 << 30 || args.depth == 0 {
        bail!("--size must be a multiple of 8 up to 1 GiB, --depth ≥ 1");
    }
    if args.depth as u64 > args.sq_blocks as u64 {
        bail!("--depth must not exceed --sq-blocks");
    }
    let measure = match args.iters {
        Some(n) => Stop::Count(n.max(1)),
        None => Stop::After(Duration::from_secs_f64(args.seconds)),
    };
    let warm = Stop::After(Duration::from_secs_f64(args.warmup));
    let ring = args.ring.name();
    let mut rows: Vec<[String; 6]> = Vec::new();
    let mut lines = Vec::new();
    let mut busiest = 0.0f64;

    let rate_tests = args
        .tests
        .iter()
        .any(|t| matches!(t, Test::Rate | Test::Burst));
    if rate_tests {
        let mut lb = Loopback::new(&args, args.ring, args.sq_blocks as usize * SLOT, true)?;
        let memcpy = memcpy_rate(args.sq_blocks as usize, measure_memcpy(measure));
        let mut run = RateRun::new(&mut lb, &args);
        for test in [Test::Rate, Test::Burst] {
            if !args.tests.contains(&test) {
                continue;
            }
            let (r, others) = if test == Test::Rate {
                run.steady(args.batch, warm)?;
                let cpu = CpuSample::now();
                (
                    run.steady(args.batch, measure)?,
                    cpu.and_then(CpuSample::others_since),
                )
            } else {
                run.bursts(warm)?;
                let cpu = CpuSample::now();
                (run.bursts(measure)?, cpu.and_then(CpuSample::others_since))
            };
            run.drain()?;
            busiest = busiest.max(others.unwrap_or(0.0));
            let name = if test == Test::Rate {
                "write_rate"
            } else {
                "write_rate_burst"
            };
            let per_db = r.msgs as f64 / r.doorbells.max(1) as f64;
            lines.push(json!({
                "test": name,
                "size": SLOT,
                "ring": ring,
                "inline": args.inline,
                "batch": if test == Test::Rate { args.batch } else { args.sq_blocks },
                "signal_every": args.signal,
                "sq_blocks": args.sq_blocks,
                "engine_threads": 1,
                "msgs": r.msgs,
                "seconds": r.secs,
                "msgs_per_s": r.rate(),
                "msgs_per_doorbell": per_db,
                "initiator_post_ns_per_msg": r.post_ns_per_msg,
                "memcpy_copies_per_s": memcpy,
                "target_msgs_per_s": TARGET_MSGS_PER_S,
                "target_met": r.rate() >= TARGET_MSGS_PER_S,
                "other_cpu_cores": others,
            }));
            rows.push([
                name.into(),
                "8 B".into(),
                format!("{}msg/s", human_rate(r.rate())),
                format!("{}copies/s", human_rate(memcpy)),
                "≥ 2 M/s/engine thread".into(),
                yes_no(r.rate() >= TARGET_MSGS_PER_S).into(),
            ]);
        }
        run.check_all_slots()?;
        drop(run);
        lb.check_clean()?;
    }

    if args.tests.contains(&Test::Bw) {
        let mut lb = Loopback::new(&args, args.ring, args.size * args.depth, true)?;
        let mut k = 1u64;
        bandwidth(&mut lb, args.size, args.depth, warm, &mut k)?;
        let cpu = CpuSample::now();
        let r = bandwidth(&mut lb, args.size, args.depth, measure, &mut k)?;
        let others = cpu.and_then(CpuSample::others_since);
        busiest = busiest.max(others.unwrap_or(0.0));
        lb.check_clean()?;
        let (gb, mc, mt) = (r.gbps(r.engine), r.gbps(r.memcpy), r.gbps(r.memcpy_thread));
        let ratio = gb / mc;
        lines.push(json!({
            "test": "write_bw",
            "size": args.size,
            "ring": ring,
            "depth": args.depth,
            "engine_threads": 1,
            "writes": r.writes,
            "seconds": r.engine.as_secs_f64(),
            "gb_per_s": gb,
            "memcpy_gb_per_s": mc,
            "ratio": ratio,
            "memcpy_other_thread_gb_per_s": mt,
            "ratio_other_thread": gb / mt,
            "target_ratio": TARGET_BW_RATIO,
            "target_met": ratio >= TARGET_BW_RATIO,
            "other_cpu_cores": others,
        }));
        rows.push([
            "write_bw".into(),
            size_name(args.size),
            format!("{gb:.2} GB/s"),
            format!(
                "{mc:.2} GB/s ({:.0}%); other thread {mt:.2} GB/s ({:.0}%)",
                ratio * 100.0,
                gb / mt * 100.0
            ),
            "≥ 50% of memcpy".into(),
            yes_no(ratio >= TARGET_BW_RATIO).into(),
        ]);
    }

    if args.tests.contains(&Test::Latency) {
        if args.latency_samples == 0 {
            bail!("--latency-samples must be ≥ 1");
        }
        let gap = Duration::from_millis(2);
        for (engine, kick, gap) in [
            ("spinning", true, Duration::ZERO),
            ("asleep", true, gap),
            ("asleep", false, gap),
        ] {
            let mut lb = Loopback::new(&args, args.ring, args.sq_blocks as usize * SLOT, kick)?;
            let cpu = CpuSample::now();
            let us = latency(&mut lb, &args, gap, args.latency_samples)?;
            let others = cpu.and_then(CpuSample::others_since);
            busiest = busiest.max(others.unwrap_or(0.0));
            lb.check_clean()?;
            let doorbell = if kick { "kicked" } else { "polled" };
            let (p50, p99, max) = (
                percentile(&us, 0.5),
                percentile(&us, 0.99),
                percentile(&us, 1.0),
            );
            lines.push(json!({
                "test": "write_latency",
                "size": SLOT,
                "ring": ring,
                "engine": engine,
                "doorbell": doorbell,
                "idle_gap_us": gap.as_micros() as u64,
                "engine_threads": 1,
                "samples": us.len(),
                "median_us": p50,
                "p99_us": p99,
                "max_us": max,
                "other_cpu_cores": others,
            }));
            rows.push([
                format!("write_latency ({engine}, {doorbell})"),
                "8 B".into(),
                format!("median {p50:.1} µs, p99 {p99:.1} µs, max {max:.1} µs"),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
    }

    if args.tests.contains(&Test::Idle) {
        let lb = Loopback::new(&args, args.ring, SLOT, false)?;
        // Let the engines fall through their spin phase into parked sleep first.
        std::thread::sleep(Duration::from_millis(500));
        let window = Duration::from_secs(3);
        let (t0, c0) = (Instant::now(), process_cpu_seconds()?);
        std::thread::sleep(window);
        let (elapsed, c1) = (t0.elapsed().as_secs_f64(), process_cpu_seconds()?);
        lb.check_clean()?;
        // Two devices, one engine thread each; nothing else of this process runs meanwhile.
        let per_engine = (c1 - c0) / elapsed / 2.0;
        lines.push(json!({
            "test": "idle_cpu",
            "engine_threads": 2,
            "window_s": elapsed,
            "cpu_cores_per_engine": per_engine,
            "target": "< 0.05",
        }));
        rows.push([
            "idle_cpu (per engine thread)".into(),
            "-".into(),
            format!("{:.2}% of a core", per_engine * 100.0),
            "-".into(),
            "< 5% of one core".into(),
            if per_engine < 0.05 { "yes" } else { "no" }.into(),
        ]);
    }

    if args.json {
        for l in &lines {
            println!("{l}");
        }
    } else {
        println!(
            "soft NIC loopback, CPU initiator: ring {ring}, batch {}, signal every {}, SQ {} blocks, {} payload, bandwidth depth {}; 1 engine thread",
            args.batch,
            args.signal,
            args.sq_blocks,
            if args.inline { "inline" } else { "SGE" },
            args.depth
        );
        let head = ["test", "size", "soft NIC", "memcpy", "target", "met"];
        let mut w = head.map(|h| h.chars().count());
        for r in &rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let s: Vec<String> = cells
                .iter()
                .zip(w)
                .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
                .collect();
            println!("{}", s.join("  ").trim_end());
        };
        line(&head.map(String::from));
        for r in &rows {
            line(r);
        }
        if busiest > 0.1 {
            println!(
                "warning: other processes used up to {busiest:.2} cores during a measurement; the figures are low"
            );
        }
    }
    Ok(())
}

/// The 8-byte memcpy reference runs a quarter of the time (it only orients).
fn measure_memcpy(s: Stop) -> Stop {
    match s {
        Stop::After(d) => Stop::After(d / 4),
        Stop::Count(n) => Stop::Count(n),
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

fn size_name(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

/// This process's user + system CPU time so far, in seconds (from /proc/self/stat).
fn process_cpu_seconds() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc/self/stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        Ok(f.get(i).context("short /proc/self/stat")?.parse::<f64>()?)
    };
    // rest starts at field 3 (state): utime is field 14, stime 15.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}
