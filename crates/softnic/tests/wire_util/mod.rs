//! Helpers of the wire tests: soft devices with a UDP port on 127.0.0.1, connected QP pairs
//! over the wire (any path MTU, fault injection on either side), and a scripted workload whose
//! completions and memory can be compared between the in-process path and the wire.
#![allow(dead_code)]

pub mod netns;

use crate::common::*;
use prm::wqe::{AtomicSize, Local, Op};
use prm::Completion;
use softnic::initiator::Initiator;
use softnic::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const ALL_REMOTE: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// Runs the tests of one binary one at a time: each wire test has four device threads of its
/// own, and a 2-core machine running several such tests at once starves them.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A device config with a wire port on 127.0.0.1 (port picked by the system).
pub fn wire_cfg(faults: WireFaults) -> DeviceConfig {
    DeviceConfig {
        wire: Some(WireConfig {
            faults,
            ..WireConfig::loopback()
        }),
        ..Default::default()
    }
}

/// A node with a wire port.
pub fn wire_node(faults: WireFaults) -> Node {
    let dev = Device::open(wire_cfg(faults)).unwrap();
    let pd = dev.alloc_pd();
    Node { dev, pd }
}

/// Makes each node's peer table point the other's GID at the other's UDP port (both GIDs are
/// `::ffff:127.0.0.1`: the ports tell them apart).
pub fn link(a: &Node, b: &Node) {
    a.dev
        .add_peer(b.dev.gid(), b.dev.wire_addr().unwrap())
        .unwrap();
    b.dev
        .add_peer(a.dev.gid(), a.dev.wire_addr().unwrap())
        .unwrap();
}

/// Options fit for lossy links on a busy machine: 268 ms ACK timeout (a loaded 2-core box
/// leaves threads unscheduled for tens, at times hundreds, of milliseconds), 7 retries,
/// infinite RNR retries. Losses are repaired by NAKs and the early retransmission timer; the
/// IBTA timer only decides when a peer is gone.
pub fn wire_opts() -> Opts {
    Opts {
        sq_blocks: 256,
        rts: RtsAttr {
            sq_psn: 0x00ff_fff0, // PSNs wrap early in every test
            timeout: 16,
            retry_cnt: 7,
            rnr_retry: 7,
        },
        // what two gpuverbs soft NICs agree on; `go_back_n_opts` for the IBTA default
        selective_repeat: true,
        ..Opts::default()
    }
}

/// [`wire_opts`] without selective repeat: go-back-N, as with any peer that did not agree
/// to it (every QP of the uverbs emulation).
pub fn go_back_n_opts() -> Opts {
    Opts {
        selective_repeat: false,
        ..wire_opts()
    }
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
    (n.dev.create_qp(cfg).unwrap(), scq, rcq)
}

/// Brings a QP to RTS against (`gid`, `qpn`); its first PSN is `o.rts.sq_psn`, the peer's
/// is `peer_psn`.
pub fn bring_up_to(q: &Qp, o: &Opts, gid: Gid, qpn: u32, peer_psn: u32, mtu: u32) {
    q.modify(Modify::Init { access: o.access }).unwrap();
    q.modify(Modify::Rtr(RtrAttr {
        remote_gid: gid,
        remote_qpn: qpn,
        rq_psn: peer_psn,
        mtu,
        min_rnr_timer: o.min_rnr_timer,
        selective_repeat: o.selective_repeat,
    }))
    .unwrap();
    q.modify(Modify::Rts(o.rts)).unwrap();
}

/// An endpoint: QP, CQs and initiator, not yet connected.
pub fn endpoint(n: &Node, o: &Opts) -> Ep {
    let (qp, scq, rcq) = make_qp(n, o);
    Ep {
        ini: Initiator::for_soft_qp(&n.dev, &qp, o.ring),
        qp,
        scq,
        rcq,
    }
}

/// Connects a QP on each node with path MTU `mtu`.
pub fn connect_mtu(a: &Node, oa: &Opts, b: &Node, ob: &Opts, mtu: u32) -> (Ep, Ep) {
    let ea = endpoint(a, oa);
    let eb = endpoint(b, ob);
    bring_up_to(&ea.qp, oa, b.dev.gid(), eb.qpn(), ob.rts.sq_psn, mtu);
    bring_up_to(&eb.qp, ob, a.dev.gid(), ea.qpn(), oa.rts.sq_psn, mtu);
    (ea, eb)
}

/// Two wire devices (faults on each one's egress) with one connected QP pair.
pub fn wire_pair(oa: Opts, ob: Opts, mtu: u32, fa: WireFaults, fb: WireFaults) -> Pair {
    let (a, b) = (wire_node(fa), wire_node(fb));
    link(&a, &b);
    let (ea, eb) = connect_mtu(&a, &oa, &b, &ob, mtu);
    Pair { a, b, ea, eb }
}

/// Two in-process devices (the reference) with one connected QP pair.
pub fn local_pair(oa: Opts, ob: Opts) -> Pair {
    let (a, b) = (Node::new(), Node::new());
    let (ea, eb) = connect_mtu(&a, &oa, &b, &ob, 4096);
    Pair { a, b, ea, eb }
}

/// Faults of every kind at the given rates.
pub fn faults(seed: u64, drop: f64, duplicate: f64, reorder: f64, corrupt: f64) -> WireFaults {
    WireFaults {
        seed,
        drop,
        duplicate,
        reorder,
        corrupt,
        stall: None,
    }
}

/// What a scripted run produced: A's send completions, B's receive completions, the final
/// bytes of every buffer, and the QP states.
#[derive(Debug, PartialEq, Eq)]
pub struct Trace {
    pub a_send: Vec<Completion>,
    pub b_recv: Vec<Completion>,
    pub mem: Vec<Vec<u8>>,
    pub states: (QpState, QpState),
}

/// Buffers of the scripted workload.
pub struct Bufs {
    /// A: gather source (random bytes).
    pub src: Buf,
    /// A: READ destination.
    pub rdst: Buf,
    /// A: atomic results.
    pub res: Buf,
    /// B: WRITE target / READ source (random bytes, every remote right).
    pub tgt: Buf,
    /// B: receive buffers.
    pub rbuf: Buf,
    /// B: atomic targets.
    pub atom: Buf,
}

pub const BIG: usize = 64 << 10;

impl Bufs {
    pub fn new(p: &Pair, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let src = p.a.buf(BIG, Access::NONE);
        src.write(0, &rng.bytes(BIG));
        let rdst = p.a.buf(BIG, Access::LOCAL_WRITE);
        let res = p.a.buf(512, Access::LOCAL_WRITE);
        let tgt = p.b.buf(BIG, ALL_REMOTE);
        tgt.write(0, &rng.bytes(BIG));
        let rbuf = p.b.buf(BIG, Access::LOCAL_WRITE);
        let atom = p.b.buf(512, ALL_REMOTE);
        atom.write(0, &rng.bytes(512));
        Self {
            src,
            rdst,
            res,
            tgt,
            rbuf,
            atom,
        }
    }
    pub fn snapshot(&self) -> Vec<Vec<u8>> {
        [
            &self.src, &self.rdst, &self.res, &self.tgt, &self.rbuf, &self.atom,
        ]
        .iter()
        .map(|b| {
            assert!(b.guards_intact(), "guard bytes written");
            b.bytes()
        })
        .collect()
    }
}

/// Runs `batches` batches of random WQEs (every opcode, inline and gather lists, lengths
/// across several MTUs, signaled and not) from A to B, each batch behind one doorbell and
/// ending with a signaled WQE; returns the trace.
pub fn run_script(p: &mut Pair, seed: u64, batches: usize) -> Trace {
    let bufs = Bufs::new(p, seed ^ 0x5a5a);
    let mut rng = Rng(seed);
    let (qa, qb) = (p.ea.qpn(), p.eb.qpn());
    let mut a_send = Vec::new();
    let mut b_recv = Vec::new();
    let mut recv_off = 0usize;
    for _ in 0..batches {
        let n = rng.range(1, 9) as usize;
        let mut recvs = 0;
        let mut last = 0;
        for i in 0..n {
            let signaled = i + 1 == n || rng.chance(1, 3);
            let kind = rng.below(9);
            let len = *rng.pick(&[0usize, 1, 7, 255, 256, 257, 1000, 4096, 5000, 9000, 20000]);
            let off = rng.below(BIG - 20000);
            let imm = rng.chance(1, 2).then(|| rng.next_u32());
            let ilen = rng.below(200);
            let inline = rng.bytes(ilen);
            let sges: Vec<_> = match rng.below(3) {
                0 => vec![bufs.src.sge(off, len as u32)],
                1 => {
                    let h = len / 3;
                    vec![
                        bufs.src.sge(off, h as u32),
                        bufs.src.sge(off + 5000, (len - h) as u32),
                    ]
                }
                _ => {
                    let h = len / 4;
                    vec![
                        bufs.src.sge(off + 17, h as u32),
                        bufs.src.sge(off + 3, h as u32),
                        bufs.src.sge(off + 11, (len - 2 * h) as u32),
                    ]
                }
            };
            // a zero byte count means 2 GiB: zero-length pieces are left out
            let sges: Vec<_> = sges.into_iter().filter(|s| s.len > 0).collect();
            let use_inline = rng.chance(1, 4);
            let local = if use_inline {
                Local::Inline(&inline)
            } else {
                Local::Sges(&sges)
            };
            let roff = rng.below(BIG - 20000);
            let aoff = rng.below(60) * 8;
            let size = if rng.chance(1, 2) {
                AtomicSize::B4
            } else {
                AtomicSize::B8
            };
            let rsges: Vec<_> = [
                bufs.rdst.sge(roff, (len / 2) as u32),
                bufs.rdst.sge(roff + 10000, (len - len / 2) as u32),
            ]
            .into_iter()
            .filter(|s| s.len > 0)
            .collect();
            let op = match kind {
                0 | 1 => Op::Write {
                    remote: bufs.tgt.remote(roff),
                    local,
                    imm: None,
                },
                2 => Op::Write {
                    remote: bufs.tgt.remote(roff),
                    local,
                    imm,
                },
                3 | 4 => Op::Send { local, imm },
                5 => Op::Read {
                    remote: bufs.tgt.remote(off),
                    local: &rsges,
                },
                6 => {
                    if rng.chance(1, 2) {
                        Op::FetchAdd {
                            remote: bufs.atom.remote(aoff),
                            add: rng.next_u64(),
                            result: bufs.res.sge(aoff, 8),
                        }
                    } else {
                        Op::CompareSwap {
                            remote: bufs.atom.remote(aoff),
                            compare: if rng.chance(1, 2) {
                                bufs.atom.u64_at(aoff)
                            } else {
                                rng.next_u64()
                            },
                            swap: rng.next_u64(),
                            result: bufs.res.sge(aoff, 8),
                        }
                    }
                }
                7 => {
                    let sz = size.bytes() as usize;
                    if rng.chance(1, 2) {
                        Op::MaskedFetchAdd {
                            size,
                            remote: bufs.atom.remote(aoff),
                            add: rng.next_u64(),
                            field_boundary: rng.next_u64(),
                            result: bufs.res.sge(aoff, sz as u32),
                        }
                    } else {
                        Op::MaskedCompareSwap {
                            size,
                            remote: bufs.atom.remote(aoff),
                            compare: rng.next_u64(),
                            compare_mask: rng.next_u64() & rng.next_u64(),
                            swap: rng.next_u64(),
                            swap_mask: rng.next_u64(),
                            result: bufs.res.sge(aoff, sz as u32),
                        }
                    }
                }
                _ => Op::Nop,
            };
            let consumes = matches!(op, Op::Send { .. } | Op::Write { imm: Some(_), .. });
            if consumes {
                // a receive large enough for any send of the script, in 1 to 3 pieces
                if recv_off + 24000 > BIG {
                    recv_off = 0;
                }
                let r = match rng.below(3) {
                    0 => vec![bufs.rbuf.sge(recv_off, 21000)],
                    1 => vec![
                        bufs.rbuf.sge(recv_off, 300),
                        bufs.rbuf.sge(recv_off + 1000, 21000),
                    ],
                    _ => vec![
                        bufs.rbuf.sge(recv_off, 10),
                        bufs.rbuf.sge(recv_off + 100, 5000),
                        bufs.rbuf.sge(recv_off + 6000, 17000),
                    ],
                };
                recv_off += 24000;
                p.eb.ini.post_recv(&r).unwrap();
                recvs += 1;
            }
            last = p.ea.post(&op, flags(signaled));
        }
        p.ea.ini.ring();
        loop {
            let c = p.ea.send_cqe();
            let stop = match c {
                Completion::Req { wqe_counter, .. } => wqe_counter == last,
                _ => {
                    eprintln!("error completion {c:?}");
                    true
                }
            };
            a_send.push(norm(c, qa, qb));
            if stop {
                break;
            }
        }
        if a_send
            .last()
            .is_some_and(|c| !matches!(c, Completion::Req { .. }))
        {
            break;
        }
        for _ in 0..recvs {
            b_recv.push(norm(p.eb.recv_cqe(), qa, qb));
        }
    }
    p.ea.expect_quiet(Duration::from_millis(5));
    p.eb.expect_quiet(Duration::ZERO);
    Trace {
        a_send,
        b_recv,
        mem: bufs.snapshot(),
        states: (p.ea.qp.state(), p.eb.qp.state()),
    }
}

/// Asserts two traces are equal, saying where they first differ.
pub fn assert_same(reference: &Trace, got: &Trace, what: &str) {
    assert_eq!(
        reference.a_send.len(),
        got.a_send.len(),
        "{what}: send CQE count"
    );
    for (i, (r, g)) in reference.a_send.iter().zip(&got.a_send).enumerate() {
        assert_eq!(r, g, "{what}: send CQE {i}");
    }
    assert_eq!(reference.b_recv, got.b_recv, "{what}: receive CQEs");
    for (i, (r, g)) in reference.mem.iter().zip(&got.mem).enumerate() {
        if r != g {
            let at = r.iter().zip(g).position(|(x, y)| x != y).unwrap_or(0);
            panic!("{what}: buffer {i} differs first at byte {at}");
        }
    }
    assert_eq!(reference.states, got.states, "{what}: QP states");
}

/// Waits until `f` holds, at most `t`.
pub fn wait_for(what: &str, t: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < t, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Fast deterministic fill (splitmix64 words).
pub fn fill_random(b: &Buf, seed: u64) {
    let mut r = Rng(seed);
    let words: Vec<u64> = (0..b.len / 8).map(|_| r.next_u64()).collect();
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    b.write(0, &bytes);
}

/// Writes `src` into `dst` (same length) in `msg`-byte RDMA WRITEs, keeping up to `depth`
/// WQEs outstanding and signaling every 8th and the last. Returns the time from the first
/// post to the last completion.
pub fn bulk_write(p: &mut Pair, src: &Buf, dst: &Buf, msg: usize, depth: usize) -> Duration {
    assert_eq!(src.len % msg, 0);
    let n = src.len / msg;
    let t0 = Instant::now();
    let mut posted = 0usize;
    let mut done = 0usize;
    let mut signaled_at = std::collections::VecDeque::new();
    while done < n {
        let mut rang = false;
        while posted < n && posted - done < depth {
            let op = Op::Write {
                remote: dst.remote(posted * msg),
                local: Local::Sges(&[src.sge(posted * msg, msg as u32)]),
                imm: None,
            };
            let sig = posted % 8 == 7 || posted + 1 == n;
            let idx = p.ea.post(&op, flags(sig));
            posted += 1;
            if sig {
                signaled_at.push_back((idx, posted));
            }
            rang = false;
            if sig {
                p.ea.ini.ring();
                rang = true;
            }
        }
        if !rang {
            p.ea.ini.ring();
        }
        match p.ea.send_cqe() {
            Completion::Req { wqe_counter, .. } => {
                let (idx, upto) = signaled_at.pop_front().expect("a signaled WQE");
                assert_eq!(wqe_counter, idx, "completion order");
                done = upto;
            }
            c => panic!(
                "bulk write failed: {c:?}\nA: {:?}\nB: {:?}",
                p.a.dev.counters().wire,
                p.b.dev.counters().wire
            ),
        }
    }
    t0.elapsed()
}

/// The frames of a capture file (`LINKTYPE_RAW`: IPv4 and UDP headers, then the datagram), as
/// (UDP source port, UDP destination port, datagram).
pub fn pcap_datagrams(path: &std::path::Path) -> Vec<(u16, u16, Vec<u8>)> {
    let data = std::fs::read(path).unwrap();
    assert_eq!(&data[..4], &0xa1b2_c3d4u32.to_le_bytes(), "pcap magic");
    let mut at = 24;
    let mut out = Vec::new();
    while at + 16 <= data.len() {
        let incl = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap()) as usize;
        let f = &data[at + 16..at + 16 + incl];
        at += 16 + incl;
        assert_eq!(f[0], 0x45, "IPv4 without options");
        let port = |i: usize| u16::from_be_bytes([f[20 + i], f[21 + i]]);
        out.push((port(0), port(2), f[28..].to_vec()));
    }
    out
}

/// Captures what `dev` receives (ingress and egress) while `f` runs, and returns the frames.
pub fn captured(dev: &Device, f: impl FnOnce()) -> Vec<(u16, u16, Vec<u8>)> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "gpuverbs-test-{}-{}.pcap",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let w = softnic::pcap::PcapWriter::create(&path).unwrap();
    dev.set_capture(Some(Capture {
        writer: w.clone(),
        ingress: true,
    }))
    .unwrap();
    f();
    dev.set_capture(None).unwrap();
    w.flush().unwrap();
    let frames = pcap_datagrams(&path);
    let _ = std::fs::remove_file(&path);
    frames
}
