//! Helpers of the device-memory tests: regions in host or simulated device memory, a scripted
//! workload of every opcode, a recording device memory, and a "GPU side" that drives a QP
//! whose rings are in device memory the way a kernel does.
#![allow(dead_code)]

use crate::common::*;
use prm::cqe::{sw_owns, Cqe64};
use prm::doorbell::{DoorbellValue, BF_OFFSET};
use prm::wqe::{AtomicSize, CtrlFlags, DataSeg, Local, Op, RemoteAddr, Sge};
use prm::{Completion, ErrorCqe, Lkey, Rkey, WQEBB};
use softnic::devmem::{DeviceMemory, DeviceMemoryError, SimDeviceMemory};
use softnic::*;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub const ALL: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// Where a test region lives: host memory, or `mem` at offset `off`.
#[derive(Clone)]
pub enum Kind {
    Host,
    Dev(Arc<SimDeviceMemory>, u64),
}

/// A registered region in host memory or simulated device memory.
pub enum Region {
    Host(Buf),
    Dev {
        mem: Arc<SimDeviceMemory>,
        mr: MrInfo,
    },
}

impl Region {
    pub fn new(n: &Node, kind: &Kind, len: usize, access: Access) -> Self {
        match kind {
            Kind::Host => Region::Host(n.buf(len, access)),
            Kind::Dev(mem, off) => {
                let dm: Arc<dyn DeviceMemory> = mem.clone();
                let mr = n
                    .dev
                    .reg_device(n.pd, mem.base() + off, len as u64, access, dm)
                    .expect("register device memory");
                assert_eq!(mr.kind, MemKind::Device);
                Region::Dev {
                    mem: mem.clone(),
                    mr,
                }
            }
        }
    }
    pub fn addr(&self, off: usize) -> u64 {
        match self {
            Region::Host(b) => b.addr(off),
            Region::Dev { mr, .. } => mr.addr + off as u64,
        }
    }
    pub fn key(&self) -> u32 {
        match self {
            Region::Host(b) => b.mr.key,
            Region::Dev { mr, .. } => mr.key,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Region::Host(b) => b.len,
            Region::Dev { mr, .. } => mr.len as usize,
        }
    }
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr(off),
            len,
            lkey: Lkey(self.key()),
        }
    }
    pub fn remote(&self, off: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr(off),
            rkey: Rkey(self.key()),
        }
    }
    /// Stores bytes (a GPU's own store for device memory: not through the trait).
    pub fn write(&self, off: usize, b: &[u8]) {
        match self {
            Region::Host(buf) => buf.write(off, b),
            Region::Dev { mem, .. } => mem.poke(self.addr(off), b),
        }
    }
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        match self {
            Region::Host(buf) => buf.read(off, len),
            Region::Dev { mem, .. } => mem.peek(self.addr(off), len),
        }
    }
    pub fn bytes(&self) -> Vec<u8> {
        self.read(0, self.len())
    }
    pub fn u64_at(&self, off: usize) -> u64 {
        u64::from_ne_bytes(self.read(off, 8).try_into().unwrap())
    }
    pub fn set_u64(&self, off: usize, v: u64) {
        self.write(off, &v.to_ne_bytes())
    }
    /// Makes every access of `off..off+len` fail (device memory only).
    pub fn fail(&self, off: usize, len: usize) {
        match self {
            Region::Host(_) => panic!("host memory cannot fail"),
            Region::Dev { mem, .. } => mem.fail_range(self.addr(off), len as u64),
        }
    }
}

/// What the script produced.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    pub completions: Vec<Completion>,
    pub local: Vec<u8>,
    pub remote: Vec<u8>,
    pub recv: Vec<u8>,
}

/// Bytes every script region starts with.
pub const REGION: usize = 8192;

/// Every opcode once, A → B, with `local` on A and `remote`, `recv` on B (each `REGION`
/// bytes): a gather WRITE, an inline WRITE, WRITE_IMM, a scatter READ, SEND_IMM into two
/// receive segments, fetch-add, compare-swap, 4-byte masked fetch-add, 8-byte masked
/// compare-swap (every result in `local`).
pub fn script(p: &mut Pair, local: &Region, remote: &Region, recv: &Region) -> Outcome {
    let mut rng = Rng(0xdec0_de00);
    local.write(0, &rng.bytes(REGION));
    remote.write(0, &rng.bytes(REGION));
    recv.write(0, &vec![0; REGION]);
    remote.set_u64(6000, 100);
    remote.set_u64(6008, 11);
    remote.write(6016, &0x00ff_00f0u32.to_ne_bytes());
    remote.set_u64(6024, 0x1111_2222_3333_4444);
    p.eb.ini.post_recv(&[recv.sge(0, 64)]).unwrap();
    p.eb.ini
        .post_recv(&[recv.sge(100, 200), recv.sge(1000, 400)])
        .unwrap();
    let inline: Vec<u8> = (0..40).map(|i| 0xa0 + i as u8).collect();
    let gather = [local.sge(0, 300), local.sge(1000, 700)];
    let scatter = [local.sge(4000, 600), local.sge(5000, 400)];
    let imm_src = [local.sge(2000, 64)];
    let send_src = [local.sge(0, 250), local.sge(3000, 250)];
    let ops = [
        Op::Write {
            remote: remote.remote(100),
            local: Local::Sges(&gather),
            imm: None,
        },
        Op::Write {
            remote: remote.remote(2000),
            local: Local::Inline(&inline),
            imm: None,
        },
        Op::Write {
            remote: remote.remote(3000),
            local: Local::Sges(&imm_src),
            imm: Some(7),
        },
        Op::Read {
            remote: remote.remote(100),
            local: &scatter,
        },
        Op::Send {
            local: Local::Sges(&send_src),
            imm: Some(9),
        },
        Op::FetchAdd {
            remote: remote.remote(6000),
            add: 5,
            result: local.sge(6000, 8),
        },
        Op::CompareSwap {
            remote: remote.remote(6008),
            compare: 11,
            swap: 22,
            result: local.sge(6008, 8),
        },
        Op::MaskedFetchAdd {
            size: AtomicSize::B4,
            remote: remote.remote(6016),
            add: 0x0001_0010,
            field_boundary: 0x0080_0080,
            result: local.sge(6016, 4),
        },
        Op::MaskedCompareSwap {
            size: AtomicSize::B8,
            remote: remote.remote(6024),
            compare: 0x0000_2222_0000_0000,
            compare_mask: 0x0000_ffff_0000_0000,
            swap: 0xaaaa_bbbb_cccc_dddd,
            swap_mask: 0xffff_0000_ffff_0000,
            result: local.sge(6024, 8),
        },
    ];
    let (qa, qb) = (p.ea.qpn(), p.eb.qpn());
    let mut completions = Vec::new();
    for op in &ops {
        p.ea.go(op, SIG);
        completions.push(norm(p.ea.send_cqe(), qa, qb));
    }
    for _ in 0..2 {
        completions.push(norm(p.eb.recv_cqe(), qa, qb));
    }
    Outcome {
        completions,
        local: local.bytes(),
        remote: remote.bytes(),
        recv: recv.bytes(),
    }
}

/// The script on host memory only: what every other placement must reproduce.
pub fn reference() -> Outcome {
    let mut p = Pair::new();
    let (l, r, v) = (
        Region::new(&p.a, &Kind::Host, REGION, ALL),
        Region::new(&p.b, &Kind::Host, REGION, ALL),
        Region::new(&p.b, &Kind::Host, REGION, ALL),
    );
    let out = script(&mut p, &l, &r, &v);
    assert!(
        out.completions
            .iter()
            .all(|c| !matches!(c, Completion::Error(_))),
        "{:?}",
        out.completions
    );
    out
}

/// A device memory that records every write and read (address, length) and every ordered
/// group of writes on the way to a `SimDeviceMemory`.
pub struct Recording {
    pub inner: Arc<SimDeviceMemory>,
    pub writes: Mutex<Vec<(u64, usize)>>,
    pub reads: Mutex<Vec<(u64, usize)>>,
    pub ordered: Mutex<Vec<Vec<(u64, usize)>>>,
}

impl Recording {
    pub fn new(inner: Arc<SimDeviceMemory>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            writes: Mutex::new(Vec::new()),
            reads: Mutex::new(Vec::new()),
            ordered: Mutex::new(Vec::new()),
        })
    }
    pub fn log(&self) -> Vec<(u64, usize)> {
        self.writes.lock().unwrap().clone()
    }
    pub fn read_log(&self) -> Vec<(u64, usize)> {
        self.reads.lock().unwrap().clone()
    }
    pub fn ordered_log(&self) -> Vec<Vec<(u64, usize)>> {
        self.ordered.lock().unwrap().clone()
    }
}

impl DeviceMemory for Recording {
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
        self.reads.lock().unwrap().push((src, dst.len()));
        self.inner.read(src, dst)
    }
    fn write_ordered(&self, parts: &[(u64, &[u8])]) -> Result<(), DeviceMemoryError> {
        let group = parts.iter().map(|&(a, b)| (a, b.len())).collect();
        self.ordered.lock().unwrap().push(group);
        parts
            .iter()
            .try_for_each(|&(dst, src)| self.write(dst, src))
    }
    fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        self.writes.lock().unwrap().push((dst, src.len()));
        self.inner.write(dst, src)
    }
    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.inner.copy(dst, src, len)
    }
}

/// A device memory that really leaves queued writes queued: `write_queued` keeps the bytes
/// until `settle` or any other call (as a CUDA memory's stream does), so a test sees whether
/// anything was reported before they landed. Counts what it queued.
pub struct Deferred {
    pub inner: Arc<SimDeviceMemory>,
    pub held: Mutex<Vec<(u64, Vec<u8>)>>,
    pub queued: std::sync::atomic::AtomicU64,
}

impl Deferred {
    pub fn new(inner: Arc<SimDeviceMemory>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            held: Mutex::new(Vec::new()),
            queued: Default::default(),
        })
    }
    fn land(&self) -> Result<(), DeviceMemoryError> {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        held.iter().try_for_each(|(a, b)| self.inner.write(*a, b))
    }
}

impl DeviceMemory for Deferred {
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceMemoryError> {
        self.land()?;
        self.inner.read(src, dst)
    }
    fn write(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        self.land()?;
        self.inner.write(dst, src)
    }
    fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), DeviceMemoryError> {
        self.land()?;
        self.inner.copy(dst, src, len)
    }
    fn write_queued(&self, dst: u64, src: &[u8]) -> Result<(), DeviceMemoryError> {
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.held.lock().unwrap().push((dst, src.to_vec()));
        Ok(())
    }
    fn settle(&self) -> Result<(), DeviceMemoryError> {
        self.land()
    }
}

/// Ring memory carved out of a simulated device memory, page by page.
pub struct Carver {
    pub mem: Arc<SimDeviceMemory>,
    pub dm: Arc<dyn DeviceMemory>,
    pub next: u64,
}

impl Carver {
    pub fn new(mem: Arc<SimDeviceMemory>, dm: Arc<dyn DeviceMemory>, start: u64) -> Self {
        Self {
            mem,
            dm,
            next: start,
        }
    }
    pub fn ring(&mut self, len: usize) -> DmaBuf {
        let at = self.mem.base() + self.next;
        self.next += (len.max(1) as u64).next_multiple_of(4096);
        DmaBuf::from_device(at, len, self.dm.clone(), Box::new(()))
    }
}

/// Which rings of a QP are in device memory.
#[derive(Clone, Copy, Debug)]
pub struct Placement {
    pub sq: bool,
    pub rq: bool,
    pub scq: bool,
    pub rcq: bool,
}

impl Placement {
    pub const ALL: Placement = Placement {
        sq: true,
        rq: true,
        scq: true,
        rcq: true,
    };
}

/// A QP with the chosen rings in device memory (`c`), the rest in host memory.
pub fn qp_on(
    n: &Node,
    c: &mut Carver,
    at: Placement,
    sq_blocks: u32,
    ncqe: u32,
) -> (Arc<Qp>, Arc<Cq>, Arc<Cq>) {
    let mut cq = |dev: bool| {
        n.dev
            .create_cq(CqConfig {
                ncqe,
                ring: dev.then(|| c.ring(ncqe as usize * 64)),
                ..Default::default()
            })
            .unwrap()
    };
    let (scq, rcq) = (cq(at.scq), cq(at.rcq));
    let mut cfg = QpConfig::new(n.pd, scq.clone(), rcq.clone());
    cfg.sq_blocks = sq_blocks;
    cfg.rq_wqes = 64;
    cfg.max_recv_sge = 4;
    cfg.sq_ring = at.sq.then(|| c.ring(sq_blocks as usize * WQEBB));
    cfg.rq_ring = at.rq.then(|| c.ring(64 * 64));
    (n.dev.create_qp(cfg).unwrap(), scq, rcq)
}

/// A QP whose rings and doorbell records (its own and its CQs', the CQs detecting overrun)
/// are all in device memory (`c`), as a GPU library that puts everything in GPU memory makes
/// them with DEVX.
pub fn qp_all_on(
    n: &Node,
    c: &mut Carver,
    sq_blocks: u32,
    ncqe: u32,
) -> (Arc<Qp>, Arc<Cq>, Arc<Cq>) {
    let mut cq = || {
        n.dev
            .create_cq(CqConfig {
                ncqe,
                mode: softnic::CqMode::OverrunDetect,
                ring: Some(c.ring(ncqe as usize * 64)),
                dbrec: Some(c.ring(8)),
                ..Default::default()
            })
            .unwrap()
    };
    let (scq, rcq) = (cq(), cq());
    let mut cfg = QpConfig::new(n.pd, scq.clone(), rcq.clone());
    cfg.sq_blocks = sq_blocks;
    cfg.rq_wqes = 64;
    cfg.max_recv_sge = 4;
    cfg.sq_ring = Some(c.ring(sq_blocks as usize * WQEBB));
    cfg.rq_ring = Some(c.ring(64 * 64));
    cfg.dbrec = Some(c.ring(8));
    (n.dev.create_qp(cfg).unwrap(), scq, rcq)
}

/// RESET → RTS towards `peer`'s QP `qpn`, every remote right granted.
pub fn bring_up(q: &Qp, peer: &Node, qpn: u32) {
    up_to_rtr(q, peer, qpn);
    q.modify(Modify::Rts(RtsAttr {
        sq_psn: 0,
        timeout: 10,
        retry_cnt: 3,
        rnr_retry: 7,
    }))
    .unwrap();
}

/// Drives a QP whose rings may be in simulated device memory the way a kernel does: WQEs and
/// receive WQEs stored into the rings (`poke`: the GPU's own stores, not the device's
/// accesses), the doorbell record and register in host memory (DOCA convention), CQEs polled
/// from the CQ rings (`peek`).
pub struct GpuSide {
    pub qp: Arc<Qp>,
    pub scq: Arc<Cq>,
    pub rcq: Arc<Cq>,
    pub mem: Arc<SimDeviceMemory>,
    pub pi: u16,
    pub sci: u32,
    pub rci: u32,
    pub rq_pi: u32,
}

impl GpuSide {
    pub fn new(qp: Arc<Qp>, scq: Arc<Cq>, rcq: Arc<Cq>, mem: Arc<SimDeviceMemory>) -> Self {
        Self {
            qp,
            scq,
            rcq,
            mem,
            pi: 0,
            sci: 0,
            rci: 0,
            rq_pi: 0,
        }
    }

    fn store(&self, ring: &DmaBuf, off: usize, bytes: &[u8]) {
        if ring.is_host() {
            ring.write(off, bytes);
        } else {
            self.mem.poke(ring.addr() + off as u64, bytes);
        }
    }

    fn load(&self, ring: &DmaBuf, off: usize, len: usize) -> Vec<u8> {
        if ring.is_host() {
            let mut v = vec![0; len];
            ring.read(off, &mut v);
            v
        } else {
            self.mem.peek(ring.addr() + off as u64, len)
        }
    }

    /// Writes one WQE into the SQ ring (no doorbell).
    pub fn post(&mut self, op: &Op<'_>, flags: CtrlFlags) -> u16 {
        let w = op.encode(self.pi, self.qp.qpn(), flags).unwrap();
        let mask = self.qp.sq_blocks() as usize - 1;
        for i in 0..w.blocks() {
            let slot = (self.pi as usize + i) & mask;
            self.store(self.qp.sq_ring(), slot * WQEBB, &w.block(i)[..]);
        }
        let idx = self.pi;
        self.pi = self.pi.wrapping_add(w.blocks() as u16);
        idx
    }

    /// A big-endian word of a doorbell record, in host memory (a store with release) or in
    /// device memory (the GPU's own store).
    fn store_word(&self, rec: &DmaBuf, off: usize, v: u32) {
        if rec.is_host() {
            rec.atomic_u32(off).store(v.to_be(), Ordering::Release);
        } else {
            self.mem.poke(rec.addr() + off as u64, &v.to_be_bytes());
        }
    }

    /// DBREC send word, then the register (host memory, as on hardware).
    pub fn ring(&self, dev: &Device) {
        self.store_word(
            self.qp.dbrec_page(),
            self.qp.dbrec_offset() + 4,
            self.pi as u32,
        );
        self.qp.uar().atomic_u64(BF_OFFSET).store(
            DoorbellValue::from_pi(self.pi, self.qp.qpn()).to_u64(),
            Ordering::Release,
        );
        dev.kick();
    }

    pub fn go(&mut self, dev: &Device, op: &Op<'_>, flags: CtrlFlags) -> u16 {
        let idx = self.post(op, flags);
        self.ring(dev);
        idx
    }

    /// Posts a receive WQE (with a terminator) into the RQ ring.
    pub fn post_recv(&mut self, sges: &[Sge]) {
        let stride = self.qp.rq_stride() as usize;
        let base = (self.rq_pi & (self.qp.rq_wqes() - 1)) as usize * stride;
        let mut wqe = Vec::new();
        for i in 0..(stride / 16).min(sges.len() + 1) {
            let seg = sges
                .get(i)
                .map_or_else(DataSeg::terminator, |s| DataSeg::new(*s));
            wqe.extend_from_slice(bytemuck::bytes_of(&seg));
        }
        self.store(self.qp.rq_ring(), base, &wqe);
        self.rq_pi = self.rq_pi.wrapping_add(1);
        self.store_word(
            self.qp.dbrec_page(),
            self.qp.dbrec_offset(),
            self.rq_pi & 0xffff,
        );
    }

    fn poll(&self, cq: &Cq, ci: &mut u32) -> Option<Completion> {
        let n = cq.ncqe();
        let slot = (*ci & (n - 1)) as usize;
        let b = self.load(cq.ring(), slot * 64, 64);
        let cqe: Cqe64 = bytemuck::pod_read_unaligned(&b);
        if cqe.opcode() == 15 || !sw_owns(cqe.op_own, *ci, n) {
            return None;
        }
        *ci = ci.wrapping_add(1);
        self.store_word(cq.dbrec(), 0, *ci & 0xff_ffff);
        Some(cqe.decode())
    }

    pub fn wait_send(&mut self) -> Completion {
        let (cq, mut ci) = (self.scq.clone(), self.sci);
        let c = wait(|| self.poll(&cq, &mut ci));
        self.sci = ci;
        c
    }

    pub fn wait_recv(&mut self) -> Completion {
        let (cq, mut ci) = (self.rcq.clone(), self.rci);
        let c = wait(|| self.poll(&cq, &mut ci));
        self.rci = ci;
        c
    }

    /// Nothing more on either CQ.
    pub fn quiet(&mut self) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (s, r) = (self.scq.clone(), self.rcq.clone());
        let (mut a, mut b) = (self.sci, self.rci);
        assert_eq!(self.poll(&s, &mut a), None);
        assert_eq!(self.poll(&r, &mut b), None);
    }
}

fn wait(mut f: impl FnMut() -> Option<Completion>) -> Completion {
    let t = Instant::now();
    loop {
        if let Some(c) = f() {
            return c;
        }
        assert!(t.elapsed() < T, "no completion within {T:?}");
        std::thread::yield_now();
    }
}

/// An exact requester error.
pub fn req_err(qpn: u32, syndrome: prm::Syndrome, vendor: u8, opcode: u8, idx: u16) -> Completion {
    Completion::Error(ErrorCqe {
        responder: false,
        syndrome: syndrome as u8,
        vendor_syndrome: vendor,
        wqe_opcode: opcode,
        qpn,
        wqe_counter: idx,
    })
}

/// RESET → RTR towards `peer`'s QP `qpn`, every remote right granted (the engine runs no
/// QP below RTS).
pub fn up_to_rtr(q: &Qp, peer: &Node, qpn: u32) {
    q.modify(Modify::Init {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    })
    .unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: peer.dev.gid(),
        remote_qpn: qpn,
        rq_psn: 0,
        mtu: 4096,
        min_rnr_timer: 1,
        selective_repeat: false,
    }))
    .unwrap();
}
