//! Helpers shared by the soft NIC's integration tests: devices, connected QP pairs driven by
//! CPU initiators, registered buffers with guard bytes, raw WQE and doorbell injection, and
//! completion checks.
#![allow(dead_code)]

use prm::doorbell::{DoorbellValue, BF_HALF_SIZE, BF_OFFSET};
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, ErrorCqe, Lkey, Rkey, Syndrome, WQEBB};
use softnic::initiator::{Initiator, RingMode};
use softnic::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long any single completion may take before a test fails.
pub const T: Duration = Duration::from_secs(10);
/// Guard bytes on each side of every test buffer (not registered).
pub const GUARD: usize = 64;
/// The value guard bytes hold.
pub const GUARD_BYTE: u8 = 0xEE;

/// A small deterministic PRNG (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    /// Uniform in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next_u64() % den < num
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// One soft device with a protection domain.
pub struct Node {
    pub dev: Device,
    pub pd: PdId,
}

impl Node {
    pub fn new() -> Self {
        let dev = Device::open(DeviceConfig::default()).unwrap();
        let pd = dev.alloc_pd();
        Self { dev, pd }
    }
    /// A registered buffer in this node's PD.
    pub fn buf(&self, len: usize, access: Access) -> Buf {
        Buf::new(&self.dev, self.pd, len, access)
    }
}

impl Default for Node {
    fn default() -> Self {
        Self::new()
    }
}

/// `len` registered bytes with `GUARD` unregistered guard bytes on each side.
///
/// The region holds a share of the memory (`Device::reg_buf`): dropping a `Buf` while WQEs
/// that name it are still in flight (a requester retransmitting to a peer that never answers)
/// leaves the memory to the device until the region goes with it.
pub struct Buf {
    pub mem: Arc<DmaBuf>,
    pub len: usize,
    pub mr: MrInfo,
}

impl Buf {
    pub fn new(dev: &Device, pd: PdId, len: usize, access: Access) -> Self {
        let mem = Arc::new(DmaBuf::alloc(len + 2 * GUARD));
        mem.fill(0, GUARD, GUARD_BYTE);
        mem.fill(GUARD + len, GUARD, GUARD_BYTE);
        let mr = dev
            .reg_buf(pd, &mem, GUARD, len, access)
            .expect("register test buffer");
        Self { mem, len, mr }
    }
    /// Address of byte `off` of the registered range.
    pub fn addr(&self, off: usize) -> u64 {
        self.mr.addr + off as u64
    }
    pub fn lkey(&self) -> Lkey {
        Lkey(self.mr.key)
    }
    pub fn rkey(&self) -> Rkey {
        Rkey(self.mr.key)
    }
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr(off),
            len,
            lkey: self.lkey(),
        }
    }
    pub fn remote(&self, off: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr(off),
            rkey: self.rkey(),
        }
    }
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        let mut v = vec![0; len];
        self.mem.read(GUARD + off, &mut v);
        v
    }
    /// The whole registered range.
    pub fn bytes(&self) -> Vec<u8> {
        self.read(0, self.len)
    }
    pub fn write(&self, off: usize, b: &[u8]) {
        assert!(off + b.len() <= self.len);
        self.mem.write(GUARD + off, b);
    }
    pub fn fill(&self, byte: u8) {
        self.mem.fill(GUARD, self.len, byte);
    }
    pub fn u64_at(&self, off: usize) -> u64 {
        u64::from_ne_bytes(self.read(off, 8).try_into().unwrap())
    }
    pub fn u32_at(&self, off: usize) -> u32 {
        u32::from_ne_bytes(self.read(off, 4).try_into().unwrap())
    }
    pub fn set_u64(&self, off: usize, v: u64) {
        self.write(off, &v.to_ne_bytes())
    }
    pub fn set_u32(&self, off: usize, v: u32) {
        self.write(off, &v.to_ne_bytes())
    }
    /// Whether the guard bytes on both sides are untouched.
    pub fn guards_intact(&self) -> bool {
        let mut g = vec![0u8; GUARD];
        self.mem.read(0, &mut g);
        let lo = g.iter().all(|&b| b == GUARD_BYTE);
        self.mem.read(GUARD + self.len, &mut g);
        lo && g.iter().all(|&b| b == GUARD_BYTE)
    }
}

/// Parameters of one side of a connection.
#[derive(Clone, Debug)]
pub struct Opts {
    pub sq_blocks: u32,
    pub rq_wqes: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
    pub doorbell: DoorbellMode,
    pub ring: RingMode,
    pub ncqe: u32,
    pub cq_mode: CqMode,
    pub cq_init: CqInit,
    /// Remote rights granted through this QP (Modify::Init).
    pub access: Access,
    pub rts: RtsAttr,
    pub min_rnr_timer: u8,
    /// RtrAttr::selective_repeat (on the wire: hold packets behind a gap, resend selectively).
    pub selective_repeat: bool,
    /// QpConfig::cross_channel (a companion: may post WAIT).
    pub cross_channel: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            sq_blocks: 64,
            rq_wqes: 64,
            max_recv_sge: 4,
            max_inline: 256,
            doorbell: DoorbellMode::GpuDoorbell,
            ring: RingMode::RdmaCore,
            ncqe: 256,
            cq_mode: CqMode::OverrunIgnore,
            cq_init: CqInit::Invalid,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            rts: RtsAttr {
                sq_psn: 0,
                timeout: 10,
                retry_cnt: 3,
                rnr_retry: 7,
            },
            min_rnr_timer: 1,
            selective_repeat: false,
            cross_channel: false,
        }
    }
}

/// One connected QP with its CQs and the CPU initiator that drives it.
pub struct Ep {
    pub ini: Initiator,
    pub qp: Arc<Qp>,
    pub scq: Arc<Cq>,
    pub rcq: Arc<Cq>,
}

fn make_qp(n: &Node, o: &Opts) -> (Arc<Qp>, Arc<Cq>, Arc<Cq>) {
    let cq = || {
        n.dev
            .create_cq(CqConfig {
                ncqe: o.ncqe,
                mode: o.cq_mode,
                init: o.cq_init,
                ring: None,
                dbrec: None,
                cqe_size: Default::default(),
            })
            .unwrap()
    };
    let (scq, rcq) = (cq(), cq());
    let mut cfg = QpConfig::new(n.pd, scq.clone(), rcq.clone());
    cfg.sq_blocks = o.sq_blocks;
    cfg.rq_wqes = o.rq_wqes;
    cfg.max_recv_sge = o.max_recv_sge;
    cfg.max_inline = o.max_inline;
    cfg.doorbell = o.doorbell;
    cfg.cross_channel = o.cross_channel;
    (n.dev.create_qp(cfg).unwrap(), scq, rcq)
}

fn bring_up(q: &Qp, o: &Opts, peer: &Node, peer_qpn: u32) {
    q.modify(Modify::Init { access: o.access }).unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: peer.dev.gid(),
        remote_qpn: peer_qpn,
        rq_psn: 0,
        mtu: 4096,
        min_rnr_timer: o.min_rnr_timer,
        selective_repeat: o.selective_repeat,
    }))
    .unwrap();
    q.modify(Modify::Rts(o.rts)).unwrap();
}

/// Creates a QP on each node, connects them and returns their endpoints.
pub fn connect(a: &Node, oa: &Opts, b: &Node, ob: &Opts) -> (Ep, Ep) {
    let (qa, sa, ra) = make_qp(a, oa);
    let (qb, sb, rb) = make_qp(b, ob);
    bring_up(&qa, oa, b, qb.qpn());
    bring_up(&qb, ob, a, qa.qpn());
    let ea = Ep {
        ini: Initiator::for_soft_qp(&a.dev, &qa, oa.ring),
        qp: qa,
        scq: sa,
        rcq: ra,
    };
    let eb = Ep {
        ini: Initiator::for_soft_qp(&b.dev, &qb, ob.ring),
        qp: qb,
        scq: sb,
        rcq: rb,
    };
    (ea, eb)
}

/// One QP of `n` connected to itself (a loopback), as a companion QP is: its atomics land in
/// its own device's memory.
pub fn self_connected(n: &Node, o: &Opts) -> Ep {
    let (q, s, r) = make_qp(n, o);
    bring_up(&q, o, n, q.qpn());
    Ep {
        ini: Initiator::for_soft_qp(&n.dev, &q, o.ring),
        qp: q,
        scq: s,
        rcq: r,
    }
}

/// Destroys an endpoint's QP and CQs.
pub fn destroy(n: &Node, ep: Ep) {
    let Ep { ini, qp, scq, rcq } = ep;
    drop(ini);
    n.dev.destroy_qp(&qp);
    n.dev.destroy_cq(&scq).unwrap();
    n.dev.destroy_cq(&rcq).unwrap();
}

/// Two devices with one connected QP pair.
pub struct Pair {
    pub a: Node,
    pub b: Node,
    pub ea: Ep,
    pub eb: Ep,
}

impl Pair {
    pub fn new() -> Self {
        Self::with(Opts::default(), Opts::default())
    }
    pub fn with(oa: Opts, ob: Opts) -> Self {
        let (a, b) = (Node::new(), Node::new());
        let (ea, eb) = connect(&a, &oa, &b, &ob);
        Self { a, b, ea, eb }
    }
}

impl Default for Pair {
    fn default() -> Self {
        Self::new()
    }
}

pub const SIG: CtrlFlags = CtrlFlags::SIGNALED;
pub const UNSIG: CtrlFlags = CtrlFlags {
    signaled: false,
    solicited: false,
    fence: prm::Fence::None,
};

pub fn flags(signaled: bool) -> CtrlFlags {
    if signaled {
        SIG
    } else {
        UNSIG
    }
}

impl Ep {
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }
    /// Posts and rings one WQE.
    pub fn go(&mut self, op: &Op<'_>, f: CtrlFlags) -> u16 {
        self.ini.post_and_ring(op, f).unwrap()
    }
    pub fn post(&mut self, op: &Op<'_>, f: CtrlFlags) -> u16 {
        self.ini.post(op, f).unwrap()
    }
    pub fn send_cqe(&mut self) -> Completion {
        self.ini.wait_send(T).expect("send completion")
    }
    pub fn recv_cqe(&mut self) -> Completion {
        self.ini.wait_recv(T).expect("receive completion")
    }
    /// Expects a successful requester CQE; returns its byte count.
    pub fn expect_req(&mut self, opcode: u8, idx: u16) -> u32 {
        let qpn = self.qpn();
        match self.send_cqe() {
            Completion::Req {
                wqe_opcode,
                qpn: q,
                wqe_counter,
                byte_cnt,
            } => {
                assert_eq!(
                    (wqe_opcode, q, wqe_counter),
                    (opcode, qpn, idx),
                    "requester CQE (opcode, qpn, wqe_counter)"
                );
                byte_cnt
            }
            c => panic!("expected REQ for opcode {opcode:#x} wqe {idx}, got {c:?}"),
        }
    }
    /// Expects an exact requester error CQE.
    pub fn expect_err(&mut self, syndrome: Syndrome, vendor: u8, opcode: u8, idx: u16) {
        let want = ErrorCqe {
            responder: false,
            syndrome: syndrome as u8,
            vendor_syndrome: vendor,
            wqe_opcode: opcode,
            qpn: self.qpn(),
            wqe_counter: idx,
        };
        assert_eq!(self.send_cqe(), Completion::Error(want));
    }
    /// Expects a WR_FLUSH requester CQE.
    pub fn expect_flush(&mut self, opcode: u8, idx: u16) {
        self.expect_err(Syndrome::WrFlush, 0, opcode, idx);
    }
    /// Expects an exact responder error CQE.
    pub fn expect_recv_err(&mut self, syndrome: Syndrome, vendor: u8, idx: u16) {
        let want = ErrorCqe {
            responder: true,
            syndrome: syndrome as u8,
            vendor_syndrome: vendor,
            wqe_opcode: 0,
            qpn: self.qpn(),
            wqe_counter: idx,
        };
        assert_eq!(self.recv_cqe(), Completion::Error(want));
    }
    /// Waits a little and checks that neither CQ holds anything.
    pub fn expect_quiet(&mut self, settle: Duration) {
        std::thread::sleep(settle);
        assert_eq!(self.ini.poll_send(), None, "unexpected send completion");
        assert_eq!(self.ini.poll_recv(), None, "unexpected receive completion");
    }
    /// Posts `n` more WQEs (alternating unsignaled and signaled NOPs and writes from a bad
    /// key: nothing may execute) and checks that each one flushes with exactly one CQE.
    pub fn expect_flushes_after(&mut self, n: usize) {
        assert_eq!(self.qp.state(), QpState::Err);
        let mut posted = Vec::new();
        for i in 0..n {
            let op = if i % 2 == 0 {
                Op::Nop
            } else {
                Op::Write {
                    remote: RemoteAddr {
                        addr: 0x1000,
                        rkey: Rkey(0x00de_ad00),
                    },
                    local: Local::Inline(b"flushed"),
                    imm: None,
                }
            };
            let opcode = op.opcode().0 as u8;
            posted.push((opcode, self.post(&op, flags(i % 3 == 1))));
        }
        self.ini.ring();
        for (opcode, idx) in posted {
            self.expect_flush(opcode, idx);
        }
        assert_eq!(self.qp.state(), QpState::Err);
    }

    /// Posts a placeholder WQE of `bytes.len() / 64` blocks through the initiator (so its
    /// bookkeeping stays right), then replaces its ring bytes with `bytes`, wrapping at the
    /// ring's end. Does not ring. `bytes` should be encoded for index `self.ini.producer()`.
    pub fn post_raw(&mut self, bytes: &[u8]) -> u16 {
        assert_eq!(bytes.len() % WQEBB, 0);
        let blocks = bytes.len() / WQEBB;
        let sges = vec![Sge::default(); (4 * blocks - 1).min(62)];
        let op = if blocks == 1 {
            Op::Nop
        } else {
            Op::Send {
                local: Local::Sges(&sges),
                imm: None,
            }
        };
        let idx = self.post(&op, SIG);
        self.overwrite_ring(idx, bytes);
        idx
    }

    /// Writes `bytes` into the SQ ring starting at block index `idx`, wrapping.
    pub fn overwrite_ring(&self, idx: u16, bytes: &[u8]) {
        let n = self.qp.sq_blocks() as usize;
        for (i, chunk) in bytes.chunks(WQEBB).enumerate() {
            let slot = (idx as usize + i) & (n - 1);
            self.qp.sq_ring().write(slot * WQEBB, chunk);
        }
    }

    /// Reads `blocks` blocks of the SQ ring starting at block index `idx`, wrapping.
    pub fn read_ring(&self, idx: u16, blocks: usize) -> Vec<u8> {
        let n = self.qp.sq_blocks() as usize;
        let mut v = vec![0u8; blocks * WQEBB];
        for i in 0..blocks {
            let slot = (idx as usize + i) & (n - 1);
            self.qp
                .sq_ring()
                .read(slot * WQEBB, &mut v[i * WQEBB..(i + 1) * WQEBB]);
        }
        v
    }

    /// Stores the send word of the doorbell record.
    pub fn set_dbrec(&self, pi: u16) {
        self.qp
            .ctrl_page()
            .atomic_u32(self.qp.dbrec_offset() + 4)
            .store((pi as u32).to_be(), Ordering::Release);
    }

    /// Stores an 8-byte doorbell value into register half `h`.
    pub fn ring_raw(&self, dev: &Device, h: usize, v: DoorbellValue) {
        self.qp
            .uar()
            .atomic_u64(BF_OFFSET + h * BF_HALF_SIZE)
            .store(v.to_u64(), Ordering::Release);
        dev.kick();
    }

    /// The current 8-byte value of register half `h`.
    pub fn reg_value(&self, h: usize) -> DoorbellValue {
        DoorbellValue::from_u64(
            self.qp
                .uar()
                .atomic_u64(BF_OFFSET + h * BF_HALF_SIZE)
                .load(Ordering::Acquire),
        )
    }
}

/// Waits until `f` holds, at most `T`.
pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < T, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Field-wise add, written independently of the engine: each field ends at a set bit of
/// `boundary` (or at the operand's top bit) and wraps within itself.
pub fn model_field_add(old: u64, add: u64, boundary: u64, bits: u32) -> u64 {
    let mut out = 0u64;
    let mut lo = 0u32;
    for i in 0..bits {
        if (boundary >> i) & 1 == 1 || i == bits - 1 {
            let width = i - lo + 1;
            let mask = if width == 64 {
                u64::MAX
            } else {
                (1u64 << width) - 1
            };
            let s = ((old >> lo) & mask).wrapping_add((add >> lo) & mask) & mask;
            out |= s << lo;
            lo = i + 1;
        }
    }
    out
}

/// A sequence of SGEs over `buf` at spread-out offsets, with the given lengths; returns the
/// SGEs and the bytes they cover in order (read from `buf` now).
pub fn spread_sges(buf: &Buf, lens: &[u32]) -> (Vec<Sge>, Vec<u8>) {
    let mut off = 3usize;
    let mut sges = Vec::new();
    for (i, &l) in lens.iter().enumerate() {
        sges.push(buf.sge(off, l));
        // gaps between pieces
        off += l as usize + 17 + 5 * i;
    }
    assert!(off <= buf.len, "buffer too small for the pieces");
    // gather in reverse address order, so order mistakes show
    sges.reverse();
    let mut ordered = Vec::new();
    for s in &sges {
        ordered.extend(buf.read((s.addr - buf.addr(0)) as usize, s.len as usize));
    }
    (sges, ordered)
}

/// A completion with QPNs replaced by role (0 = A, 1 = B), so runs with different QPNs compare.
pub fn norm(c: Completion, qa: u32, qb: u32) -> Completion {
    let r = |q: u32| match q {
        q if q == qa => 0,
        q if q == qb => 1,
        _ => 0xbad,
    };
    match c {
        Completion::Req {
            wqe_opcode,
            qpn,
            wqe_counter,
            byte_cnt,
        } => Completion::Req {
            wqe_opcode,
            qpn: r(qpn),
            wqe_counter,
            byte_cnt,
        },
        Completion::Resp {
            kind,
            qpn,
            wqe_counter,
            byte_cnt,
            imm,
            remote_qpn,
        } => Completion::Resp {
            kind,
            qpn: r(qpn),
            wqe_counter,
            byte_cnt,
            imm,
            remote_qpn: r(remote_qpn),
        },
        Completion::Error(e) => Completion::Error(ErrorCqe { qpn: r(e.qpn), ..e }),
        other => other,
    }
}

/// Software's side of an SRQ, as libmlx5 keeps it: head (next WQE to post), tail (last free).
pub struct SwSrq {
    pub srq: Arc<Srq>,
    pub head: u16,
    pub tail: u16,
    pub posted: u32,
}

impl SwSrq {
    pub fn new(srq: Arc<Srq>) -> Self {
        let tail = (srq.wqes() - 1) as u16;
        Self {
            srq,
            head: 0,
            tail,
            posted: 0,
        }
    }
    pub fn wqe(&self, i: u16) -> usize {
        i as usize * self.srq.stride() as usize
    }
    pub fn next(&self, i: u16) -> u16 {
        let mut b = [0u8; 2];
        self.srq.ring().read(self.wqe(i) + 2, &mut b);
        u16::from_be_bytes(b)
    }
    /// Posts one receive of one data segment; returns its WQE index.
    pub fn post(&mut self, addr: u64, len: u32, lkey: u32) -> u16 {
        assert_ne!(self.head, self.tail, "SRQ full");
        let i = self.head;
        let mut seg = [0u8; 16];
        seg[..4].copy_from_slice(&len.to_be_bytes());
        seg[4..8].copy_from_slice(&lkey.to_be_bytes());
        seg[8..].copy_from_slice(&addr.to_be_bytes());
        self.srq.ring().write(self.wqe(i) + 16, &seg);
        // terminator
        let mut t = [0u8; 16];
        t[4..8].copy_from_slice(&0x100u32.to_be_bytes());
        self.srq.ring().write(self.wqe(i) + 32, &t);
        self.head = self.next(i);
        self.posted += 1;
        self.srq
            .dbrec()
            .atomic_u32(0)
            .store(self.posted.to_be(), std::sync::atomic::Ordering::Release);
        i
    }
    /// Links a completed WQE at the tail of the free list.
    pub fn free(&mut self, i: u16) {
        let w = self.wqe(self.tail) + 2;
        self.srq.ring().write(w, &i.to_be_bytes());
        self.tail = i;
    }
}
