//! Randomized differential test: seeded random streams of valid and invalid WQEs (writes,
//! reads, atomics, sends with receives, NOPs; bad keys, out-of-range addresses, missing rights,
//! misaligned atomics, oversized sends, malformed WQEs) run against the soft NIC through the
//! CPU initiator and against a reference model written here over plain `Vec<u8>` memories
//! (first error moves the QP to ERR, every later WQE flushes). Final memories and the
//! sequences of requester and responder CQEs must agree.
//!
//! The stream is cut into episodes: each gets a fresh QP pair (random SQ size, doorbell
//! convention, BlueFlame or not, and now and then a responder QP without some remote right)
//! on the same two devices and the same registered memory, which carries over.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use prm::wqe::{AtomicSize, Local, Op, RemoteAddr, Sge, INLINE_SEG};
use prm::{Completion, Lkey, Rkey, Syndrome};
use softnic::initiator::RingMode;
use softnic::{Access, DoorbellMode};
use std::collections::VecDeque;

const SEED: u64 = 0xd1ff_5eed_2024;
const TOTAL_WQES: usize = 6000;
const MAX_INLINE: u32 = 128;
const MAX_RECV_SGE: u32 = 3;

const ALL: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

// ------------------------------------------------------------------------- the stream

#[derive(Clone, Debug)]
enum L {
    Inline(Vec<u8>),
    Sges(Vec<Sge>),
}

#[derive(Clone, Copy, Debug)]
enum At {
    Fa {
        add: u64,
    },
    Cs {
        compare: u64,
        swap: u64,
    },
    MFa {
        size: AtomicSize,
        add: u64,
        boundary: u64,
    },
    MCs {
        size: AtomicSize,
        compare: u64,
        cmask: u64,
        swap: u64,
        smask: u64,
    },
}

impl At {
    fn size(&self) -> u32 {
        match self {
            At::Fa { .. } | At::Cs { .. } => 8,
            At::MFa { size, .. } | At::MCs { size, .. } => size.bytes(),
        }
    }
}

/// Malformed WQEs, written into the ring by hand (all one block).
#[derive(Clone, Copy, Debug)]
enum Raw {
    /// An opcode the device does not implement.
    Opcode(u8),
    /// An opmod on a WRITE.
    Opmod,
    /// A WRITE of ds 1.
    ShortWrite,
    /// A SEND whose inline byte count claims more units than the WQE has.
    InlineCount,
}

#[derive(Clone, Debug)]
enum G {
    Nop,
    Write {
        remote: RemoteAddr,
        local: L,
        imm: Option<u32>,
    },
    Send {
        local: L,
        imm: Option<u32>,
    },
    Read {
        remote: RemoteAddr,
        sges: Vec<Sge>,
    },
    Atomic {
        remote: RemoteAddr,
        at: At,
        result: Sge,
    },
    Raw(Raw),
}

impl G {
    fn op(&self) -> Op<'_> {
        fn local(l: &L) -> Local<'_> {
            match l {
                L::Inline(b) => Local::Inline(b),
                L::Sges(s) => Local::Sges(s),
            }
        }
        match self {
            G::Nop | G::Raw(_) => Op::Nop,
            G::Write {
                remote,
                local: l,
                imm,
            } => Op::Write {
                remote: *remote,
                local: local(l),
                imm: *imm,
            },
            G::Send { local: l, imm } => Op::Send {
                local: local(l),
                imm: *imm,
            },
            G::Read { remote, sges } => Op::Read {
                remote: *remote,
                local: sges,
            },
            G::Atomic { remote, at, result } => {
                let (remote, result) = (*remote, *result);
                match *at {
                    At::Fa { add } => Op::FetchAdd {
                        remote,
                        add,
                        result,
                    },
                    At::Cs { compare, swap } => Op::CompareSwap {
                        remote,
                        compare,
                        swap,
                        result,
                    },
                    At::MFa {
                        size,
                        add,
                        boundary,
                    } => Op::MaskedFetchAdd {
                        size,
                        remote,
                        add,
                        field_boundary: boundary,
                        result,
                    },
                    At::MCs {
                        size,
                        compare,
                        cmask,
                        swap,
                        smask,
                    } => Op::MaskedCompareSwap {
                        size,
                        remote,
                        compare,
                        compare_mask: cmask,
                        swap,
                        swap_mask: smask,
                        result,
                    },
                }
            }
        }
    }

    /// The WQE's bytes for a raw WQE at index `idx`.
    fn raw_bytes(r: Raw, idx: u16, qpn: u32) -> Vec<u8> {
        let enc = |op: Op<'_>| op.encode(idx, qpn, SIG).unwrap().as_bytes().to_vec();
        let write8 = Op::Write {
            remote: RemoteAddr::default(),
            local: Local::Inline(&[9; 8]),
            imm: None,
        };
        let mut b = match r {
            Raw::Opcode(_) | Raw::ShortWrite => enc(Op::Nop),
            Raw::Opmod => enc(write8),
            Raw::InlineCount => enc(Op::Send {
                local: Local::Inline(&[7; 20]),
                imm: None,
            }),
        };
        match r {
            Raw::Opcode(x) => b[3] = x,
            Raw::Opmod => b[0] = 3,
            Raw::ShortWrite => b[3] = 0x08,
            Raw::InlineCount => b[16..20].copy_from_slice(&(40 | INLINE_SEG).to_be_bytes()),
        }
        assert_eq!(b.len(), 64);
        b
    }

    /// The opcode byte the device sees in the control segment.
    fn opcode_byte(&self) -> u8 {
        match self {
            G::Raw(Raw::Opcode(x)) => *x,
            G::Raw(Raw::Opmod | Raw::ShortWrite) => 0x08,
            G::Raw(Raw::InlineCount) => 0x0a,
            g => g.op().opcode().0 as u8,
        }
    }
}

mod model;
use model::*;

// ------------------------------------------------------------------------- the world

struct World {
    a: Node,
    b: Node,
    /// A: gather source (no rights), scatter target (LOCAL_WRITE), and a region in another PD.
    a_src: Buf,
    a_dst: Buf,
    a_other: Buf,
    /// B: every right, remote read only, receive buffers (LOCAL_WRITE only).
    b_rw: Buf,
    b_ro: Buf,
    b_recv: Buf,
}

impl World {
    fn bufs(&self) -> [&Buf; 6] {
        [
            &self.a_src,
            &self.a_dst,
            &self.a_other,
            &self.b_rw,
            &self.b_ro,
            &self.b_recv,
        ]
    }
}

fn mmr(b: &Buf, pd: u32, mem: usize) -> MMr {
    MMr {
        key: b.mr.key,
        pd,
        addr: b.mr.addr,
        len: b.mr.len,
        access: b.mr.access.0,
        mem,
    }
}

/// Generates WQEs for one episode.
struct Gen<'w> {
    w: &'w World,
    rng: Rng,
    raw_ok: bool,
    /// Receives the episode will post (their SGEs), in order.
    recvs: Vec<Vec<Sge>>,
}

const BAD_KEY: u32 = 0x00de_ad00;

impl Gen<'_> {
    fn piece(&mut self, len: u32) -> Sge {
        let b = if self.rng.chance(1, 2) {
            &self.w.a_src
        } else {
            &self.w.a_dst
        };
        let off = self.rng.below(b.len - len as usize + 1);
        b.sge(off, len)
    }

    /// A local source of exactly `len` bytes: inline or 1..=4 pieces.
    fn local(&mut self, len: u32) -> L {
        if len <= MAX_INLINE && self.rng.chance(1, 3) {
            return L::Inline(self.rng.bytes(len as usize));
        }
        if len == 0 {
            return L::Sges(vec![]);
        }
        let n = (self.rng.range(1, 5) as u32).min(len);
        let mut cuts: Vec<u32> = (0..n - 1)
            .map(|_| self.rng.range(1, len as u64) as u32)
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut sges = Vec::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([len]) {
            sges.push(self.piece(c - prev));
            prev = c;
        }
        L::Sges(sges)
    }

    /// Breaks one SGE of a local source (bad key, range, PD or a zero byte count).
    fn break_local(&mut self, l: &mut L) -> bool {
        let L::Sges(sges) = l else { return false };
        if sges.is_empty() {
            return false;
        }
        let i = self.rng.below(sges.len());
        let s = &mut sges[i];
        match self.rng.below(4) {
            0 => s.lkey = Lkey(BAD_KEY | self.rng.below(256) as u32),
            1 => {
                let b = if s.lkey == self.w.a_src.lkey() {
                    &self.w.a_src
                } else {
                    &self.w.a_dst
                };
                let past = if self.rng.chance(1, 2) {
                    0
                } else {
                    self.rng.below(8)
                };
                s.addr = b.addr(b.len - s.len as usize + 1 + past);
            }
            2 => *s = self.w.a_other.sge(0, s.len.min(64)),
            _ => s.len = 0,
        }
        true
    }

    fn remote(&mut self, b: &Buf, len: u32, align: u64) -> RemoteAddr {
        let max = (b.len - len as usize) as u64 / align;
        // the very end of the region now and then
        let off = if self.rng.chance(1, 8) {
            max
        } else {
            self.rng.range(0, max + 1)
        } * align;
        b.remote(off as usize)
    }

    /// Breaks a remote address (bad key, range, or a region without the right).
    fn break_remote(&mut self, r: &mut RemoteAddr, len: u32, wrong_region: &Buf) {
        match self.rng.below(3) {
            0 => r.rkey = Rkey(BAD_KEY | self.rng.below(256) as u32),
            1 => {
                let b = &self.w.b_rw;
                let past = if self.rng.chance(1, 2) {
                    0
                } else {
                    self.rng.below(16)
                };
                r.addr = b.addr(b.len - len as usize + 1 + past);
                r.rkey = b.rkey();
            }
            _ => *r = self.remote(wrong_region, len, 8),
        }
    }

    fn new_recv(&mut self) -> usize {
        let n = self.rng.range(1, MAX_RECV_SGE as u64 + 1) as usize;
        let b = &self.w.b_recv;
        let mut sges: Vec<Sge> = (0..n)
            .map(|_| {
                let len = self.rng.range(1, 101) as u32;
                let off = self.rng.below(b.len - len as usize + 1);
                b.sge(off, len)
            })
            .collect();
        if self.rng.chance(1, 150) {
            let i = self.rng.below(n);
            sges[i].lkey = Lkey(BAD_KEY);
        }
        let cap = sges.iter().map(|s| s.len as usize).sum();
        self.recvs.push(sges);
        cap
    }

    fn atomic(&mut self, model: &Model) -> G {
        let size = if self.rng.chance(1, 3) { 4u32 } else { 8 };
        let remote = self.remote(&self.w.b_rw, size, size as u64);
        let cur = {
            let off = (remote.addr - self.w.b_rw.addr(0)) as usize;
            let m = &model.mems[3][off..off + size as usize];
            let mut r = [0u8; 8];
            r[..size as usize].copy_from_slice(m);
            if size == 8 {
                u64::from_ne_bytes(r)
            } else {
                u32::from_ne_bytes(r[..4].try_into().unwrap()) as u64
            }
        };
        let v = self.rng.next_u64();
        let maybe_cur = |rng: &mut Rng| if rng.chance(1, 2) { cur } else { v };
        let at = if size == 4 {
            let s = AtomicSize::B4;
            if self.rng.chance(1, 2) {
                At::MFa {
                    size: s,
                    add: self.rng.next_u64(),
                    boundary: self.rng.next_u64(),
                }
            } else {
                At::MCs {
                    size: s,
                    compare: maybe_cur(&mut self.rng),
                    cmask: self.rng.next_u64(),
                    swap: self.rng.next_u64(),
                    smask: self.rng.next_u64(),
                }
            }
        } else {
            match self.rng.below(4) {
                0 => At::Fa {
                    add: self.rng.next_u64(),
                },
                1 => At::Cs {
                    compare: maybe_cur(&mut self.rng),
                    swap: self.rng.next_u64(),
                },
                2 => At::MFa {
                    size: AtomicSize::B8,
                    add: self.rng.next_u64(),
                    boundary: self.rng.next_u64(),
                },
                _ => At::MCs {
                    size: AtomicSize::B8,
                    compare: maybe_cur(&mut self.rng),
                    cmask: self.rng.next_u64(),
                    swap: self.rng.next_u64(),
                    smask: self.rng.next_u64(),
                },
            }
        };
        let off = self.rng.below(self.w.a_dst.len - 8);
        G::Atomic {
            remote,
            at,
            result: self.w.a_dst.sge(off, size),
        }
    }

    /// One WQE; invalid with probability about 1/70.
    fn next(&mut self, model: &Model) -> G {
        let bad = self.rng.chance(1, 70);
        let kind = self.rng.below(100);
        let mut g = match kind {
            0..=9 => G::Nop,
            10..=34 => {
                let len = self.rng.range(0, 200) as u32;
                let mut local = self.local(len);
                let imm = self.rng.chance(1, 4).then(|| self.rng.next_u32());
                let mut remote = self.remote(&self.w.b_rw, len, 1);
                if bad {
                    match self.rng.below(3) {
                        0 if self.break_local(&mut local) => {}
                        1 => {
                            let n = MAX_INLINE as usize + 1 + self.rng.below(40);
                            local = L::Inline(self.rng.bytes(n));
                        }
                        _ => self.break_remote(&mut remote, len.max(1), &self.w.b_ro),
                    }
                }
                if imm.is_some() {
                    self.new_recv();
                }
                G::Write { remote, local, imm }
            }
            35..=54 => {
                let cap = self.new_recv() as u32;
                // often exactly the receive's size, or (invalid) one byte more
                let mut len = if self.rng.chance(1, 4) {
                    cap
                } else {
                    self.rng.range(0, cap as u64 + 1) as u32
                };
                if bad && self.rng.chance(1, 2) {
                    len = cap
                        + if self.rng.chance(1, 2) {
                            1
                        } else {
                            self.rng.range(1, 17) as u32
                        };
                }
                let mut local = self.local(len);
                if bad && self.rng.chance(1, 2) {
                    self.break_local(&mut local);
                }
                let imm = self.rng.chance(1, 3).then(|| self.rng.next_u32());
                G::Send { local, imm }
            }
            55..=74 => {
                let n = self.rng.range(1, 5) as usize;
                let mut sges: Vec<Sge> = (0..n)
                    .map(|_| {
                        let len = self.rng.range(1, 64) as u32;
                        let off = self.rng.below(self.w.a_dst.len - len as usize + 1);
                        self.w.a_dst.sge(off, len)
                    })
                    .collect();
                let len: u32 = sges.iter().map(|s| s.len).sum();
                let src = if self.rng.chance(1, 3) {
                    &self.w.b_ro
                } else {
                    &self.w.b_rw
                };
                let mut remote = self.remote(src, len, 1);
                if bad {
                    match self.rng.below(3) {
                        0 => {
                            let mut l = L::Sges(sges.clone());
                            self.break_local(&mut l);
                            if let L::Sges(s) = l {
                                sges = s;
                            }
                        }
                        1 => {
                            // a READ into memory without LOCAL_WRITE
                            let i = self.rng.below(n);
                            let l = sges[i].len;
                            sges[i] = self
                                .w
                                .a_src
                                .sge(self.rng.below(self.w.a_src.len - l as usize), l);
                        }
                        _ => self.break_remote(&mut remote, len, &self.w.b_recv),
                    }
                }
                G::Read { remote, sges }
            }
            75..=94 => {
                let mut g = self.atomic(model);
                if bad {
                    if let G::Atomic { remote, at, result } = &mut g {
                        let size = at.size();
                        match self.rng.below(4) {
                            0 => remote.addr += self.rng.range(1, size as u64),
                            1 => result.len = if size == 8 { 4 } else { 8 },
                            2 => result.lkey = Lkey(BAD_KEY),
                            _ => self.break_remote(remote, size, &self.w.b_ro),
                        }
                    }
                }
                g
            }
            _ => G::Nop,
        };
        if bad && self.raw_ok && self.rng.chance(1, 4) {
            g = G::Raw(match self.rng.below(4) {
                0 => Raw::Opcode(*self.rng.pick(&[0x01, 0x0c, 0x13, 0x16, 0x1b, 0xff])),
                1 => Raw::Opmod,
                2 => Raw::ShortWrite,
                _ => Raw::InlineCount,
            });
            // a raw WQE may have displaced a receive-consuming one; its receive stays posted
        }
        g
    }
}

fn key_of(c: Completion, req_qpn: u32, resp_qpn: u32, resp_from: u32, requester: bool) -> K {
    match c {
        Completion::Req {
            wqe_opcode,
            qpn,
            wqe_counter,
            byte_cnt,
        } => {
            assert!(requester && qpn == req_qpn, "{c:?}");
            let meaningful = matches!(wqe_opcode, 0x10 | 0x11 | 0x12 | 0x14 | 0x15);
            K {
                op: 0,
                syndrome: 0,
                counter: wqe_counter,
                wqe_opcode,
                bytes: if meaningful { byte_cnt } else { 0 },
                imm: None,
            }
        }
        Completion::Resp {
            kind,
            qpn,
            wqe_counter,
            byte_cnt,
            imm,
            remote_qpn,
        } => {
            assert!(
                !requester && qpn == resp_qpn && remote_qpn == resp_from,
                "{c:?}"
            );
            let op = match kind {
                prm::cqe::RespKind::WriteImm => 1,
                prm::cqe::RespKind::Send => 2,
                prm::cqe::RespKind::SendImm => 3,
                prm::cqe::RespKind::SendInv => 4,
            };
            K {
                op,
                syndrome: 0,
                counter: wqe_counter,
                wqe_opcode: 0,
                bytes: byte_cnt,
                imm,
            }
        }
        Completion::Error(e) => {
            assert_eq!(e.responder, !requester, "{c:?}");
            assert_eq!(e.qpn, if requester { req_qpn } else { resp_qpn }, "{c:?}");
            if e.syndrome == Syndrome::WrFlush as u8 {
                assert_eq!(e.vendor_syndrome, 0, "{c:?}");
            }
            K {
                op: if requester { 13 } else { 14 },
                syndrome: e.syndrome,
                counter: e.wqe_counter,
                wqe_opcode: if requester { e.wqe_opcode } else { 0 },
                bytes: 0,
                imm: None,
            }
        }
        Completion::Invalid(x) => panic!("invalid CQE opcode {x}"),
    }
}

#[test]
fn random_streams_match_the_reference_model() {
    let (a, b) = (Node::new(), Node::new());
    let a_pd2 = a.dev.alloc_pd();
    let w = World {
        a_src: a.buf(2048, Access::NONE),
        a_dst: a.buf(2048, Access::LOCAL_WRITE),
        a_other: Buf::new(&a.dev, a_pd2, 256, Access::LOCAL_WRITE),
        b_rw: b.buf(4096, ALL),
        b_ro: b.buf(1024, Access::REMOTE_READ),
        b_recv: b.buf(2048, Access::LOCAL_WRITE),
        a,
        b,
    };
    let mut rng = Rng(SEED);
    let mut model = Model {
        mems: Vec::new(),
        a_mrs: vec![
            mmr(&w.a_src, w.a.pd.0, 0),
            mmr(&w.a_dst, w.a.pd.0, 1),
            mmr(&w.a_other, a_pd2.0, 2),
        ],
        b_mrs: vec![
            mmr(&w.b_rw, w.b.pd.0, 3),
            mmr(&w.b_ro, w.b.pd.0, 4),
            mmr(&w.b_recv, w.b.pd.0, 5),
        ],
        a_pd: w.a.pd.0,
        b_pd: w.b.pd.0,
        b_access: 0,
        a_err: false,
        b_err: false,
        recvs: VecDeque::new(),
        req: Vec::new(),
        resp: Vec::new(),
    };
    for buf in w.bufs() {
        let bytes = rng.bytes(buf.len);
        buf.write(0, &bytes);
        model.mems.push(bytes);
    }

    let (mut wqes, mut episodes, mut failed_episodes, mut flushed) =
        (0usize, 0usize, 0usize, 0usize);
    let mut resp_errors = 0usize;
    while wqes < TOTAL_WQES {
        episodes += 1;
        let ep_no = episodes;
        // ---- episode setup
        let (ring, doorbell) = match rng.below(3) {
            0 => (RingMode::RdmaCore, DoorbellMode::GpuDoorbell),
            1 => (RingMode::Doca, DoorbellMode::GpuDoorbell),
            _ => (RingMode::BlueFlame, DoorbellMode::BlueFlame),
        };
        let sq_blocks = *rng.pick(&[16u32, 32, 64]);
        let mut b_access = ALL.0 & !Access::LOCAL_WRITE.0;
        if rng.chance(1, 8) {
            b_access &= !*rng.pick(&[
                Access::REMOTE_WRITE.0,
                Access::REMOTE_READ.0,
                Access::REMOTE_ATOMIC.0,
            ]);
        }
        let oa = Opts {
            sq_blocks,
            ring,
            doorbell,
            max_inline: MAX_INLINE,
            ..Opts::default()
        };
        let ob = Opts {
            rq_wqes: 256,
            max_recv_sge: MAX_RECV_SGE,
            access: Access(b_access),
            ..Opts::default()
        };
        let (mut ea, mut eb) = connect(&w.a, &oa, &w.b, &ob);
        model.b_access = b_access;
        model.a_err = false;
        model.b_err = false;
        model.req.clear();
        model.resp.clear();

        // ---- generate the episode: batches of WQEs that fit the ring
        let len = rng.range(5, 90) as usize;
        let mut gen = Gen {
            w: &w,
            rng: Rng(rng.next_u64()),
            raw_ok: doorbell == DoorbellMode::GpuDoorbell,
            recvs: Vec::new(),
        };
        // atomics peek at the model's memory as of the episode's start, so that compare
        // values hit now and then
        let mut batches: Vec<Vec<(G, bool)>> = Vec::new();
        let mut n = 0;
        while n < len {
            let mut batch = Vec::new();
            let mut room = sq_blocks as usize;
            let k = gen.rng.range(1, 9) as usize;
            while batch.len() < k && n < len {
                let g = gen.next(&model);
                let blocks = g.op().encode(0, 1, SIG).unwrap().blocks();
                if blocks > room {
                    break;
                }
                room -= blocks;
                let signaled = gen.rng.chance(1, 2);
                batch.push((g, signaled));
                n += 1;
            }
            if batch.is_empty() {
                continue;
            }
            batch.last_mut().unwrap().1 = true;
            batches.push(batch);
        }
        // the receives: one per receive-consuming WQE, plus a few never used
        for _ in 0..gen.rng.below(3) {
            gen.new_recv();
        }
        for (i, sges) in gen.recvs.iter().enumerate() {
            let idx = eb.ini.post_recv(sges).unwrap();
            assert_eq!(idx as usize, i);
            model.recvs.push_back((idx, sges.clone()));
        }

        // ---- run the batches on the device and on the model
        let mut dev_req = Vec::new();
        for batch in &batches {
            let mut last = 0;
            for (g, signaled) in batch {
                let idx = match g {
                    G::Raw(r) => {
                        let bytes = G::raw_bytes(*r, ea.ini.producer(), ea.qpn());
                        ea.post_raw(&bytes)
                    }
                    g => ea.post(&g.op(), flags(*signaled)),
                };
                // a raw WQE is posted signaled (it fails anyway)
                let signaled = *signaled || matches!(g, G::Raw(_));
                model.run(g, idx, signaled);
                last = idx;
                wqes += 1;
            }
            ea.ini.ring();
            loop {
                let c = ea.send_cqe();
                let k = key_of(c, ea.qpn(), eb.qpn(), ea.qpn(), true);
                dev_req.push(k);
                if k.counter == last {
                    break;
                }
                assert!(
                    dev_req.len() <= model.req.len(),
                    "episode {ep_no}: extra requester CQE {k:?}"
                );
            }
        }
        assert_eq!(
            ea.ini.poll_send(),
            None,
            "episode {ep_no}: requester CQE after the last WQE"
        );
        for (i, (d, m)) in dev_req.iter().zip(&model.req).enumerate() {
            assert_eq!(d, m, "episode {ep_no}: requester CQE #{i} differs");
        }
        assert_eq!(
            dev_req.len(),
            model.req.len(),
            "episode {ep_no}: requester CQE count"
        );
        // responder CQEs: as many as the model expects, then nothing
        let mut dev_resp = Vec::new();
        for _ in 0..model.resp.len() {
            dev_resp.push(key_of(eb.recv_cqe(), ea.qpn(), eb.qpn(), ea.qpn(), false));
        }
        assert_eq!(
            dev_resp, model.resp,
            "episode {ep_no}: responder CQEs differ"
        );
        assert_eq!(
            eb.ini.poll_recv(),
            None,
            "episode {ep_no}: extra responder CQE"
        );
        assert_eq!(ea.ini.poll_recv(), None);
        // states
        let st = |e: bool| {
            if e {
                softnic::QpState::Err
            } else {
                softnic::QpState::Rts
            }
        };
        assert_eq!(
            ea.qp.state(),
            st(model.a_err),
            "episode {ep_no}: requester state"
        );
        assert_eq!(
            eb.qp.state(),
            st(model.b_err),
            "episode {ep_no}: responder state"
        );
        // memories
        for (i, buf) in w.bufs().iter().enumerate() {
            let got = buf.bytes();
            if got != model.mems[i] {
                let first = got
                    .iter()
                    .zip(&model.mems[i])
                    .position(|(x, y)| x != y)
                    .unwrap();
                panic!("episode {ep_no}: buffer {i} differs from the model at byte {first}");
            }
            assert!(
                buf.guards_intact(),
                "episode {ep_no}: guard bytes of buffer {i}"
            );
        }
        failed_episodes += model.a_err as usize;
        flushed += model
            .req
            .iter()
            .filter(|k| k.syndrome == Syndrome::WrFlush as u8)
            .count();
        resp_errors += model
            .resp
            .iter()
            .filter(|k| k.op == 14 && k.syndrome != Syndrome::WrFlush as u8)
            .count();
        model.recvs.clear();
        destroy(&w.a, ea);
        destroy(&w.b, eb);
    }
    eprintln!(
        "differential: {wqes} WQEs in {episodes} episodes, {failed_episodes} ended in error, \
         {flushed} flushed, {resp_errors} responder errors"
    );
    // the mix must actually exercise both paths
    assert!(
        failed_episodes >= episodes / 5 && failed_episodes < episodes,
        "{failed_episodes} of {episodes}"
    );
    assert!(flushed > 100);
}
