//! Every opcode × {signaled, unsignaled behind a later signaled WQE} × {inline, 1..4 data
//! segments} where the shape applies: payloads checked byte for byte (and nothing written
//! around them), requester CQEs (opcode, wqe_counter, qpn, byte count where meaningful) and
//! responder CQEs (opcode, byte count, immediate, wqe_counter, qpn, remote qpn).

mod common;

use common::*;
use prm::cqe::RespKind;
use prm::wqe::{AtomicSize, CtrlFlags, Fence, Local, Op, Opcode, RemoteAddr, Sge};
use prm::{Completion, Rkey, Syndrome};
use softnic::outcome::vendor;
use softnic::{Access, QpState};
use std::time::Duration;

#[derive(Clone, Copy, Debug)]
enum Shape {
    Inline(usize),
    Sges(usize),
}

const SHAPES: [Shape; 6] = [
    Shape::Inline(0),
    Shape::Inline(45),
    Shape::Sges(1),
    Shape::Sges(2),
    Shape::Sges(3),
    Shape::Sges(4),
];
/// Piece lengths of gather lists (the first n are used).
const LENS: [u32; 4] = [13, 64, 7, 100];

const RW: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);

/// Posts `op` (signaled, or unsignaled followed by a signaled NOP in the same doorbell) and
/// checks the one requester CQE that results. Returns (index of op, requester byte count
/// when the op itself was signaled).
fn run(ep: &mut Ep, op: &Op<'_>, signaled: bool) -> (u16, Option<u32>) {
    let opcode = op.opcode().0 as u8;
    let idx = ep.post(op, flags(signaled));
    if signaled {
        ep.ini.ring();
        (idx, Some(ep.expect_req(opcode, idx)))
    } else {
        let nop = ep.post(&Op::Nop, SIG);
        ep.ini.ring();
        assert_eq!(ep.expect_req(Opcode::Nop as u8, nop), 0);
        (idx, None)
    }
}

fn expect_resp(ep: &mut Ep, kind: RespKind, idx: u16, len: usize, imm: Option<u32>, from: u32) {
    let want = Completion::Resp {
        kind,
        qpn: ep.qpn(),
        wqe_counter: idx,
        byte_cnt: len as u32,
        imm,
        remote_qpn: from,
    };
    assert_eq!(ep.recv_cqe(), want);
}

#[test]
fn write_and_write_imm_every_shape() {
    let mut p = Pair::new();
    let src = p.a.buf(4096, Access::NONE);
    let dst = p.b.buf(4096, RW);
    let rbuf = p.b.buf(256, Access::LOCAL_WRITE);
    let mut rng = Rng(0x5eed_0001);
    src.write(0, &rng.bytes(4096));
    let mut recv_idx = 0u16;
    let mut n = 0;
    for imm in [None, Some(0xc0ff_ee00u32)] {
        for signaled in [true, false] {
            for shape in SHAPES {
                n += 1;
                dst.fill(0);
                let inline = rng.bytes(45);
                let (sges, payload) = match shape {
                    Shape::Inline(k) => (vec![], inline[..k].to_vec()),
                    Shape::Sges(k) => spread_sges(&src, &LENS[..k]),
                };
                let local = match shape {
                    Shape::Inline(_) => Local::Inline(&payload),
                    Shape::Sges(_) => Local::Sges(&sges),
                };
                let imm = imm.map(|i| i + n);
                if imm.is_some() {
                    // receive without buffers (terminator only), and one with a buffer that
                    // must stay untouched: WRITE_IMM consumes the WQE, not its buffers
                    let r = if n % 2 == 0 {
                        vec![]
                    } else {
                        vec![rbuf.sge(0, 256)]
                    };
                    assert_eq!(p.eb.ini.post_recv(&r).unwrap(), recv_idx);
                }
                let off = rng.below(1000) + 1;
                let op = Op::Write {
                    remote: dst.remote(off),
                    local,
                    imm,
                };
                let (_, bc) = run(&mut p.ea, &op, signaled);
                if let Some(bc) = bc {
                    assert_eq!(bc as usize, payload.len(), "{shape:?}");
                }
                let mut want = vec![0u8; 4096];
                want[off..off + payload.len()].copy_from_slice(&payload);
                assert!(
                    dst.bytes() == want,
                    "{shape:?} imm {imm:?} signaled {signaled}"
                );
                assert!(dst.guards_intact());
                if imm.is_some() {
                    let from = p.ea.qpn();
                    expect_resp(
                        &mut p.eb,
                        RespKind::WriteImm,
                        recv_idx,
                        payload.len(),
                        imm,
                        from,
                    );
                    recv_idx += 1;
                } else {
                    assert_eq!(p.eb.ini.poll_recv(), None, "plain WRITE made a receive CQE");
                }
            }
        }
    }
    assert!(
        rbuf.bytes().iter().all(|&b| b == 0),
        "receive buffer written"
    );
    assert!(rbuf.guards_intact());
    p.ea.expect_quiet(Duration::from_millis(2));
    p.eb.expect_quiet(Duration::ZERO);
}

#[test]
fn send_and_send_imm_every_shape() {
    let mut p = Pair::new();
    let src = p.a.buf(4096, Access::NONE);
    let rbuf = p.b.buf(4096, Access::LOCAL_WRITE);
    let mut rng = Rng(0x5eed_0002);
    src.write(0, &rng.bytes(4096));
    // receive scatter lists of 1..4 SGEs, each holding at least 200 bytes
    let recv_lens: [&[u32]; 4] = [&[256], &[20, 300], &[7, 33, 300], &[1, 10, 20, 300]];
    let mut recv_idx = 0u16;
    let mut n = 0u32;
    for imm in [None, Some(0x1234_5600u32)] {
        for signaled in [true, false] {
            for shape in SHAPES {
                n += 1;
                rbuf.fill(0);
                let inline = rng.bytes(45);
                let (sges, payload) = match shape {
                    Shape::Inline(k) => (vec![], inline[..k].to_vec()),
                    Shape::Sges(k) => spread_sges(&src, &LENS[..k]),
                };
                let local = match shape {
                    Shape::Inline(_) => Local::Inline(&payload),
                    Shape::Sges(_) => Local::Sges(&sges),
                };
                let imm = imm.map(|i| i + n);
                // scatter list at spread offsets of the receive buffer
                let lens = recv_lens[n as usize % 4];
                let mut rs: Vec<Sge> = Vec::new();
                let mut off = 5usize;
                for &l in lens {
                    rs.push(rbuf.sge(off, l));
                    off += l as usize + 11;
                }
                rs.reverse();
                assert_eq!(p.eb.ini.post_recv(&rs).unwrap(), recv_idx);
                let op = Op::Send { local, imm };
                run(&mut p.ea, &op, signaled);
                let kind = if imm.is_some() {
                    RespKind::SendImm
                } else {
                    RespKind::Send
                };
                let from = p.ea.qpn();
                expect_resp(&mut p.eb, kind, recv_idx, payload.len(), imm, from);
                recv_idx += 1;
                // the payload scattered in list order, nothing else written
                let mut want = vec![0u8; 4096];
                let mut at = 0;
                for s in &rs {
                    let o = (s.addr - rbuf.addr(0)) as usize;
                    let k = (payload.len() - at).min(s.len as usize);
                    want[o..o + k].copy_from_slice(&payload[at..at + k]);
                    at += k;
                }
                assert!(
                    rbuf.bytes() == want,
                    "{shape:?} imm {imm:?} signaled {signaled}"
                );
                assert!(rbuf.guards_intact());
            }
        }
    }
    p.ea.expect_quiet(Duration::from_millis(2));
    p.eb.expect_quiet(Duration::ZERO);
}

#[test]
fn read_every_shape() {
    let mut p = Pair::new();
    let dst = p.a.buf(4096, Access::LOCAL_WRITE);
    let src = p.b.buf(4096, Access::REMOTE_READ);
    let mut rng = Rng(0x5eed_0003);
    src.write(0, &rng.bytes(4096));
    for signaled in [true, false] {
        for k in 1..=4 {
            dst.fill(0);
            let (sges, _) = spread_sges(&dst, &LENS[..k]);
            let len: usize = LENS[..k].iter().sum::<u32>() as usize;
            let off = rng.below(3000);
            let op = Op::Read {
                remote: src.remote(off),
                local: &sges,
            };
            let (_, bc) = run(&mut p.ea, &op, signaled);
            if let Some(bc) = bc {
                assert_eq!(bc as usize, len);
            }
            let remote = src.read(off, len);
            let mut want = vec![0u8; 4096];
            let mut at = 0;
            for s in &sges {
                let o = (s.addr - dst.addr(0)) as usize;
                want[o..o + s.len as usize].copy_from_slice(&remote[at..at + s.len as usize]);
                at += s.len as usize;
            }
            assert!(dst.bytes() == want, "{k} SGEs signaled {signaled}");
            assert!(dst.guards_intact());
        }
    }
    // inline data is not a shape READ accepts
    let w = Op::Write {
        remote: src.remote(0),
        local: Local::Inline(&[1, 2, 3]),
        imm: None,
    }
    .encode(p.ea.ini.producer(), p.ea.qpn(), SIG)
    .unwrap();
    let mut b = w.as_bytes().to_vec();
    b[3] = Opcode::RdmaRead as u8;
    let idx = p.ea.post_raw(&b);
    p.ea.ini.ring();
    p.ea.expect_err(
        prm::Syndrome::LocalQpOp,
        softnic::outcome::vendor::MALFORMED_WQE,
        0x10,
        idx,
    );
    assert_eq!(p.eb.ini.poll_recv(), None);
}

#[test]
fn field_add_model_sanity() {
    // two 4-bit fields: 0xF + 1 wraps inside the low field
    assert_eq!(model_field_add(0x0F, 0x01, 0x08, 8), 0x00);
    assert_eq!(model_field_add(0x0F, 0x01, 0x00, 8), 0x10);
    assert_eq!(model_field_add(u64::MAX, 1, 0, 64), 0);
    assert_eq!(model_field_add(0xFFFF_FFFF, 1, 0, 32), 0);
    for (o, a, b, bits) in [
        (
            0x1234_5678_9abc_def0u64,
            0x0f0f_0f0f_0f0f_0f0f,
            0x8080_8080_8080_8080,
            64,
        ),
        (0xdead_beef, 0x1111_1111, 0x0000_8000, 32),
        (
            0xffff_0000_ffff_0000,
            0x0001_0001_0001_0001,
            0x0000_8000_0000_8000,
            64,
        ),
    ] {
        assert_eq!(
            model_field_add(o, a, b, bits),
            softnic::responder::field_add(o, a, b, bits),
            "{o:#x} {a:#x} {b:#x}"
        );
    }
}

#[derive(Clone, Copy, Debug)]
enum At {
    Fa(u64),
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

#[test]
fn atomics_every_kind() {
    let mut p = Pair::new();
    let res = p.a.buf(64, Access::LOCAL_WRITE);
    let tgt = p.b.buf(256, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC);
    let v8 = 0x0123_4567_89ab_cdefu64;
    let v4 = 0x8899_aabbu32;
    let cases = [
        At::Fa(5),
        At::Fa(u64::MAX), // wraps: subtract 1
        At::Cs {
            compare: v8,
            swap: 0xfeed,
        },
        At::Cs {
            compare: v8 ^ 1,
            swap: 0xfeed,
        }, // compare fails
        At::MFa {
            size: AtomicSize::B8,
            add: 0x0101_0101_0101_01ff,
            boundary: 0x8080_8080_8080_8080,
        },
        At::MFa {
            size: AtomicSize::B8,
            add: 7,
            boundary: 0,
        },
        At::MFa {
            size: AtomicSize::B4,
            add: 0x0001_ffff,
            boundary: 0x0000_8000,
        },
        At::MFa {
            size: AtomicSize::B4,
            add: 0x1111_1111,
            boundary: 0,
        },
        At::MCs {
            size: AtomicSize::B8,
            compare: v8 & 0xff,
            cmask: 0xff,
            swap: 0xaaaa_0000,
            smask: 0xffff_0000,
        },
        At::MCs {
            size: AtomicSize::B8,
            compare: 0,
            cmask: 0xff,
            swap: 0xaaaa_0000,
            smask: 0xffff_0000,
        },
        At::MCs {
            size: AtomicSize::B4,
            compare: v4 as u64 & 0xff00,
            cmask: 0xff00,
            swap: 0x1234_5678,
            smask: 0x0000_ffff,
        },
        At::MCs {
            size: AtomicSize::B4,
            compare: 0x1,
            cmask: 0x1,
            swap: 0x1234_5678,
            smask: 0xffff_ffff,
        },
    ];
    for signaled in [true, false] {
        for (n, case) in cases.into_iter().enumerate() {
            tgt.fill(0x5a);
            res.fill(0xab);
            let size = match case {
                At::MFa { size, .. } | At::MCs { size, .. } => size,
                _ => AtomicSize::B8,
            };
            // 8-byte operands at an 8-aligned offset; 4-byte ones alternately at the low and
            // the high half of an 8-byte word
            let toff = 64
                + 8 * n
                + if size == AtomicSize::B4 && n % 2 == 1 {
                    4
                } else {
                    0
                };
            let roff = 8 + if size == AtomicSize::B4 {
                4 * (n % 2)
            } else {
                0
            };
            let old = match size {
                AtomicSize::B8 => {
                    tgt.set_u64(toff, v8);
                    v8
                }
                AtomicSize::B4 => {
                    tgt.set_u32(toff, v4);
                    v4 as u64
                }
            };
            let result = res.sge(roff, size.bytes());
            let remote = tgt.remote(toff);
            let bits = size.bytes() * 8;
            let trunc = |x: u64| if bits == 32 { x & 0xffff_ffff } else { x };
            let (op, new) = match case {
                At::Fa(add) => (
                    Op::FetchAdd {
                        remote,
                        add,
                        result,
                    },
                    old.wrapping_add(add),
                ),
                At::Cs { compare, swap } => (
                    Op::CompareSwap {
                        remote,
                        compare,
                        swap,
                        result,
                    },
                    if old == compare { swap } else { old },
                ),
                At::MFa { add, boundary, .. } => (
                    Op::MaskedFetchAdd {
                        size,
                        remote,
                        add,
                        field_boundary: boundary,
                        result,
                    },
                    model_field_add(old, trunc(add), trunc(boundary), bits),
                ),
                At::MCs {
                    compare,
                    cmask,
                    swap,
                    smask,
                    ..
                } => (
                    Op::MaskedCompareSwap {
                        size,
                        remote,
                        compare,
                        compare_mask: cmask,
                        swap,
                        swap_mask: smask,
                        result,
                    },
                    if (old & cmask) == (compare & cmask) {
                        (old & !trunc(smask)) | (trunc(swap) & smask)
                    } else {
                        old
                    },
                ),
            };
            let (_, bc) = run(&mut p.ea, &op, signaled);
            if let Some(bc) = bc {
                assert_eq!(bc, size.bytes(), "{case:?}");
            }
            // target: new value, neighbours untouched
            let mut want_t = vec![0x5au8; 256];
            let mut want_r = vec![0xabu8; 64];
            match size {
                AtomicSize::B8 => {
                    want_t[toff..toff + 8].copy_from_slice(&new.to_ne_bytes());
                    want_r[roff..roff + 8].copy_from_slice(&old.to_ne_bytes());
                }
                AtomicSize::B4 => {
                    // the 4-byte original value lands big-endian (as a ConnectX writes it)
                    want_t[toff..toff + 4].copy_from_slice(&(new as u32).to_ne_bytes());
                    want_r[roff..roff + 4].copy_from_slice(&(old as u32).to_be_bytes());
                }
            }
            assert_eq!(
                tgt.bytes(),
                want_t,
                "target after {case:?} signaled {signaled}"
            );
            assert_eq!(
                res.bytes(),
                want_r,
                "result after {case:?} signaled {signaled}"
            );
            assert!(tgt.guards_intact() && res.guards_intact());
            assert_eq!(p.eb.ini.poll_recv(), None);
        }
    }
    // concurrency-free sanity: a run of fetch-adds accumulates
    tgt.set_u64(0, 0);
    for i in 0..20u64 {
        let op = Op::FetchAdd {
            remote: tgt.remote(0),
            add: i,
            result: res.sge(0, 8),
        };
        run(&mut p.ea, &op, i % 2 == 0);
    }
    assert_eq!(tgt.u64_at(0), (0..20).sum::<u64>());
    p.ea.expect_quiet(Duration::from_millis(2));
}

#[test]
fn nop_and_fences() {
    let mut p = Pair::new();
    let dst = p.b.buf(64, RW);
    for signaled in [true, false] {
        let (_, bc) = run(&mut p.ea, &Op::Nop, signaled);
        assert_eq!(bc.unwrap_or(0), 0);
    }
    // fenced WQEs run in order like any other
    for (i, fence) in [Fence::None, Fence::Small, Fence::Strong]
        .into_iter()
        .enumerate()
    {
        let f = CtrlFlags {
            signaled: true,
            solicited: i == 1,
            fence,
        };
        let data = [i as u8 + 1; 8];
        let op = Op::Write {
            remote: dst.remote(8 * i),
            local: Local::Inline(&data),
            imm: None,
        };
        let idx = p.ea.go(&op, f);
        p.ea.expect_req(0x08, idx);
        assert_eq!(dst.read(8 * i, 8), data);
    }
    p.ea.expect_quiet(Duration::from_millis(2));
    p.eb.expect_quiet(Duration::ZERO);
}

#[test]
fn wait_holds_the_queue_until_the_cq_index() {
    for signaled in [true, false] {
        // A posts WAIT: a cross-channel master
        let oa = Opts {
            cross_channel: true,
            ..Opts::default()
        };
        let mut p = Pair::with(oa, Opts::default());
        let dst = p.b.buf(64, RW);
        let rbuf = p.a.buf(64, Access::LOCAL_WRITE);
        // already satisfied: CQE "number -1" (0xff_ffff, before the first) counts as written
        let w0 = Op::Wait {
            cqn: p.ea.rcq.cqn(),
            max_index: 0xff_ffff,
        };
        run(&mut p.ea, &w0, signaled);
        // WAIT for A's first receive completion (CQE number 0), then a WRITE
        let wait = Op::Wait {
            cqn: p.ea.rcq.cqn(),
            max_index: 0,
        };
        let widx = p.ea.post(&wait, flags(signaled));
        let data = *b"after the wait!!";
        let write = Op::Write {
            remote: dst.remote(0),
            local: Local::Inline(&data),
            imm: None,
        };
        let idx = p.ea.post(&write, SIG);
        p.ea.ini.ring();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(p.ea.ini.poll_send(), None, "WAIT did not hold the queue");
        assert_eq!(dst.read(0, 16), [0u8; 16], "WQE behind a WAIT ran early");
        // B sends to A: A's receive CQ reaches index 1
        p.ea.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
        let sidx = p.eb.go(
            &Op::Send {
                local: Local::Inline(b"go"),
                imm: None,
            },
            SIG,
        );
        p.eb.expect_req(0x0a, sidx);
        let from = p.eb.qpn();
        expect_resp(&mut p.ea, RespKind::Send, 0, 2, None, from);
        if signaled {
            p.ea.expect_req(Opcode::Wait as u8, widx);
        }
        p.ea.expect_req(0x08, idx);
        assert_eq!(dst.read(0, 16), data);
        assert_eq!(rbuf.read(0, 2), b"go");
        p.ea.expect_quiet(Duration::from_millis(2));
    }
}

/// GPUNetIO's counter pattern (`doca_gpunetio_dev_verbs_counter.cuh`'s put_counter): a
/// WRITE on the main QP, and on a companion QP a WAIT naming the main send CQ with the WRITE's
/// WQE index as `max_index` (0 on a fresh QP), then a fetch-add of a counter. With the WRITE's
/// completion delayed, the counter must not move before that CQE exists, and must move after.
#[test]
fn a_counter_behind_a_wait_never_moves_before_the_counted_write_completes() {
    let o = Opts {
        access: Access(RW.0 | Access::REMOTE_ATOMIC.0),
        ..Opts::default()
    };
    let mut p = Pair::with(o.clone(), o.clone());
    // the companion posts WAIT: a cross-channel master
    let oc = Opts {
        cross_channel: true,
        ..o.clone()
    };
    let (mut companion, _peer) = connect(&p.a, &oc, &p.b, &o);
    let dst = p.b.buf(4096, Access(RW.0 | Access::REMOTE_ATOMIC.0));
    let res = p.a.buf(64, Access::LOCAL_WRITE);
    let delay = Duration::from_millis(150);
    p.ea.qp.inject(softnic::Fault::DelayCompletions(delay));
    for round in 0..3u64 {
        let write = Op::Write {
            remote: dst.remote(0),
            local: Local::Inline(b"counted payload!"),
            imm: None,
        };
        let widx = p.ea.go(&write, SIG);
        let wait = Op::Wait {
            cqn: p.ea.scq.cqn(),
            max_index: widx as u32,
        };
        let fa = Op::FetchAdd {
            remote: dst.remote(1024),
            add: 1,
            result: res.sge(0, 8),
        };
        companion.post(&wait, UNSIG);
        let fidx = companion.post(&fa, SIG);
        companion.ini.ring();
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(
            dst.u64_at(1024),
            round,
            "the counter moved before its WRITE's CQE (round {round})"
        );
        assert_eq!(
            companion.ini.poll_send(),
            None,
            "the fetch-add completed early"
        );
        p.ea.expect_req(0x08, widx);
        companion.expect_req(Opcode::AtomicFa as u8, fidx);
        assert_eq!(dst.u64_at(1024), round + 1);
        assert_eq!(dst.read(0, 16), b"counted payload!");
    }
}

#[test]
fn zero_length_rdma_ignores_key_and_address() {
    // IBTA C9-88: a zero-length RDMA WRITE, WRITE_IMM or READ is not checked against its
    // R_Key or address (rxe and ConnectX accept any; UCX sends rkey 0 and VA 0). The QP's
    // access flags still are: without REMOTE_WRITE on the responder a zero-length WRITE is a
    // remote access error.
    let mut p = Pair::new();
    let rbuf = p.b.buf(64, Access::LOCAL_WRITE);
    for (addr, rkey) in [(0, 0), (0xdead_beef_0000, 0x00de_ad00)] {
        let remote = RemoteAddr {
            addr,
            rkey: Rkey(rkey),
        };
        let w = Op::Write {
            remote,
            local: Local::Sges(&[]),
            imm: None,
        };
        let (_, bytes) = run(&mut p.ea, &w, true);
        assert_eq!(bytes, Some(0));
        // (no SGE: in an mlx5 data segment a byte count of 0 means 2 GiB)
        let r = Op::Read { remote, local: &[] };
        let (_, bytes) = run(&mut p.ea, &r, true);
        assert_eq!(bytes, Some(0));
        let recv_idx = p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
        let wi = Op::Write {
            remote,
            local: Local::Sges(&[]),
            imm: Some(7),
        };
        run(&mut p.ea, &wi, true);
        expect_resp(
            &mut p.eb,
            RespKind::WriteImm,
            recv_idx,
            0,
            Some(7),
            p.ea.qpn(),
        );
    }
    assert_eq!(p.ea.qp.state(), QpState::Rts);
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    // the access flags are checked all the same
    let mut p = Pair::with(
        Opts::default(),
        Opts {
            access: Access::REMOTE_READ,
            ..Opts::default()
        },
    );
    let w = Op::Write {
        remote: RemoteAddr {
            addr: 0,
            rkey: Rkey(0),
        },
        local: Local::Sges(&[]),
        imm: None,
    };
    let idx = p.ea.post(&w, SIG);
    p.ea.ini.ring();
    p.ea.expect_err(Syndrome::RemoteAccess, vendor::REMOTE_KEY, 0x08, idx);
}
