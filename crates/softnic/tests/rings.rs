//! Ring geometry: SQ wrap with multi-block WQEs over many laps in both doorbell conventions,
//! RQ and CQ wrap, both initial CQ fills, collapsed and overrun-detect CQs, BlueFlame (and
//! proof that the register copy is what executes), full rings and repeated doorbells.

mod common;

use common::*;
use prm::cqe::{sw_owns, Cqe64, RespKind, OP_OWN_INVALID, OP_OWN_INVALID_OWNED};
use prm::doorbell::{DoorbellValue, BF_HALF_SIZE, BF_OFFSET};
use prm::wqe::{Local, Op, Sge};
use prm::{Completion, WQEBB};
use softnic::initiator::RingMode;
use softnic::{Access, CqInit, CqMode, DoorbellMode, QpState};
use std::sync::atomic::Ordering;
use std::time::Duration;

const RW: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);

/// SGE counts k such that a WRITE (ds = 2 + k) spans `blocks` blocks.
fn sges_for_blocks(rng: &mut Rng, blocks: usize) -> usize {
    let lo = (4 * blocks as u64).saturating_sub(5).max(1);
    let hi = (4 * blocks as u64 - 2).min(prm::MAX_DS as u64 - 2);
    let k = rng.range(lo, hi + 1) as usize;
    assert_eq!(prm::wqe::blocks_for_ds(2 + k as u8), blocks);
    k
}

/// An inline length such that a WRITE carrying it spans `blocks` (1..=4) blocks.
fn inline_len_for_blocks(rng: &mut Rng, blocks: usize) -> usize {
    // units u of the inline segment: 2 + u in (4 (blocks - 1), 4 blocks]
    let u = rng.range(
        (4 * blocks as u64).saturating_sub(5).max(1),
        4 * blocks as u64 - 1,
    );
    let len = rng.range((16 * (u - 1)).saturating_sub(3), 16 * u - 4 + 1) as usize;
    assert_eq!(
        prm::wqe::blocks_for_ds(2 + (4 + len).div_ceil(16) as u8),
        blocks
    );
    len
}

/// A WRITE of `blocks` blocks gathering small pieces of `src`; returns the SGEs and the bytes.
fn gather(rng: &mut Rng, src: &Buf, blocks: usize) -> (Vec<Sge>, Vec<u8>) {
    let k = sges_for_blocks(rng, blocks);
    let mut sges = Vec::new();
    let mut bytes = Vec::new();
    for _ in 0..k {
        let off = rng.below(src.len - 4);
        let len = rng.range(1, 4) as u32;
        sges.push(src.sge(off, len));
        bytes.extend(src.read(off, len as usize));
    }
    (sges, bytes)
}

struct Sent {
    idx: u16,
    blocks: usize,
    off: usize,
    bytes: Vec<u8>,
}

/// Runs `laps` laps of an `sq_blocks`-block SQ with WRITEs of 1..=4 blocks (and now and then
/// one as large as the ring), 1..3 per doorbell, and checks every payload.
fn sq_laps(mode: RingMode, kind: DoorbellMode, sq_blocks: u32, laps: u32, seed: u64) -> u32 {
    let oa = Opts {
        sq_blocks,
        ring: mode,
        doorbell: kind,
        ..Opts::default()
    };
    let mut p = Pair::with(oa, Opts::default());
    let src = p.a.buf(4096, Access::NONE);
    let dst = p.b.buf(8192, RW);
    let mut rng = Rng(seed);
    src.write(0, &rng.bytes(4096));
    let mut wraps = 0;
    let mut dst_off = 0usize;
    while (p.ea.ini.producer() as u32) < laps * sq_blocks {
        let mut batch: Vec<Sent> = Vec::new();
        let mut room = sq_blocks as usize;
        let n = rng.range(1, 4);
        for j in 0..n {
            let blocks = if j == 0 && rng.chance(1, 12) {
                sq_blocks as usize // a WQE as large as the ring
            } else {
                rng.range(1, room.min(4) as u64 + 1) as usize
            };
            // the last WQE of a doorbell is signaled, so the batch completes
            let last = j + 1 == n || blocks == room;
            let (sges, bytes, inline);
            if blocks <= 4 && rng.chance(1, 3) {
                inline = true;
                let len = inline_len_for_blocks(&mut rng, blocks);
                bytes = rng.bytes(len);
                sges = vec![];
            } else {
                inline = false;
                (sges, bytes) = gather(&mut rng, &src, blocks);
            }
            let local = if inline {
                Local::Inline(&bytes)
            } else {
                Local::Sges(&sges)
            };
            if dst_off + bytes.len() > 8192 {
                dst_off = 0;
            }
            let op = Op::Write {
                remote: dst.remote(dst_off),
                local,
                imm: None,
            };
            let f = flags(last || rng.chance(1, 2));
            assert_eq!(op.encode(0, 1, f).unwrap().blocks(), blocks);
            let idx = p.ea.post(&op, f);
            if (idx as usize % sq_blocks as usize) + blocks > sq_blocks as usize {
                wraps += 1;
                // the blocks of a wrapping WQE sit at the ring's end and then its start
                let want = op.encode(idx, p.ea.qpn(), f).unwrap();
                assert_eq!(p.ea.read_ring(idx, blocks), want.as_bytes());
            }
            batch.push(Sent {
                idx,
                blocks,
                off: dst_off,
                bytes: bytes.clone(),
            });
            dst_off += bytes.len() + 1;
            room -= blocks;
            if last {
                break;
            }
        }
        p.ea.ini.ring();
        // the signaled WQEs complete (the last one always)
        let last = batch.last().unwrap().idx;
        loop {
            match p.ea.send_cqe() {
                Completion::Req { wqe_counter, .. } if wqe_counter == last => break,
                Completion::Req { wqe_counter, .. } => {
                    assert!(batch.iter().any(|s| s.idx == wqe_counter));
                }
                c => panic!("{c:?}"),
            }
        }
        for s in &batch {
            assert_eq!(
                dst.read(s.off, s.bytes.len()),
                s.bytes,
                "WQE {} ({} blocks)",
                s.idx,
                s.blocks
            );
        }
    }
    assert_eq!(p.ea.qp.state(), QpState::Rts);
    assert!(dst.guards_intact());
    p.ea.expect_quiet(Duration::from_millis(1));
    wraps
}

#[test]
fn sq_wraps_over_many_laps_rdma_core_doorbells() {
    let wraps = sq_laps(RingMode::RdmaCore, DoorbellMode::GpuDoorbell, 8, 40, 11);
    assert!(wraps >= 10, "only {wraps} WQEs wrapped");
}

#[test]
fn sq_wraps_over_many_laps_doca_doorbells() {
    let wraps = sq_laps(RingMode::Doca, DoorbellMode::GpuDoorbell, 8, 40, 12);
    assert!(wraps >= 10, "only {wraps} WQEs wrapped");
}

#[test]
fn sq_wraps_over_many_laps_blueflame() {
    // 16-block ring: WQEs of up to 4 blocks travel in the register, larger ones (a 16-block
    // one now and then) from the ring
    let wraps = sq_laps(RingMode::BlueFlame, DoorbellMode::BlueFlame, 16, 30, 13);
    assert!(wraps >= 10, "only {wraps} WQEs wrapped");
}

#[test]
fn sq_16_bit_counter_wraps() {
    // 70 000 blocks of NOPs (16 blocks each, raw) on a 1024-block ring: the 16-bit WQE index
    // in the control segment, the doorbell and the CQE all wrap through 0xffff -> 0
    let oa = Opts {
        sq_blocks: 1024,
        ring: RingMode::Doca,
        ..Opts::default()
    };
    let mut p = Pair::with(oa, Opts::default());
    let dst = p.b.buf(64, RW);
    let mut total = 0u32;
    while total < 70_000 {
        let mut last = 0;
        for j in 0..64 {
            let pi = p.ea.ini.producer();
            let mut w = Op::Nop
                .encode(pi, p.ea.qpn(), flags(j == 63))
                .unwrap()
                .as_bytes()
                .to_vec();
            w[7] = (w[7] & !0x3f) | 63;
            w.resize(16 * WQEBB, 0);
            last = p.ea.post_raw(&w);
        }
        p.ea.ini.ring();
        p.ea.expect_req(0, last);
        total += 1024;
    }
    let op = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(b"wrapped"),
        imm: None,
    };
    let idx = p.ea.go(&op, SIG);
    assert_eq!(idx as u32, total & 0xffff);
    p.ea.expect_req(0x08, idx);
    assert_eq!(dst.read(0, 7), b"wrapped");
}

#[test]
fn full_ring_in_one_doorbell() {
    for mode in [RingMode::RdmaCore, RingMode::Doca] {
        let oa = Opts {
            sq_blocks: 8,
            ring: mode,
            ..Opts::default()
        };
        let mut p = Pair::with(oa, Opts::default());
        let dst = p.b.buf(64, RW);
        for round in 0..5u8 {
            let mut last = 0;
            for i in 0..8u8 {
                let data = [round * 8 + i];
                let op = Op::Write {
                    remote: dst.remote(i as usize),
                    local: Local::Inline(&data),
                    imm: None,
                };
                last = p.ea.post(&op, flags(i == 7));
            }
            assert_eq!(p.ea.ini.outstanding(), 8);
            assert!(
                p.ea.ini.post(&Op::Nop, SIG).is_err(),
                "a ninth block fitted"
            );
            p.ea.ini.ring();
            p.ea.expect_req(0x08, last);
            let want: Vec<u8> = (0..8).map(|i| round * 8 + i).collect();
            assert_eq!(dst.read(0, 8), want);
        }
    }
}

#[test]
fn rq_wraps_over_many_laps() {
    let ob = Opts {
        rq_wqes: 4,
        max_recv_sge: 2,
        ..Opts::default()
    };
    let mut p = Pair::with(Opts::default(), ob);
    let rbuf = p.b.buf(1024, Access::LOCAL_WRITE);
    let mut rng = Rng(21);
    let mut posted = 0u32;
    let mut recv_slots = std::collections::VecDeque::new();
    for n in 0..60u32 {
        // keep 1..4 receives posted ahead
        while posted < n + 1 + rng.below(3) as u32 && posted - n < 4 {
            let slot = (posted % 8) as usize * 128;
            let a = rng.range(1, 40) as u32;
            let sges = [rbuf.sge(slot, a), rbuf.sge(slot + 64, 64)];
            let i = p.eb.ini.post_recv(&sges).unwrap();
            assert_eq!(i, posted as u16);
            recv_slots.push_back((slot, a));
            posted += 1;
        }
        let len = rng.below(60);
        let payload = rng.bytes(len);
        let imm = (n % 2 == 0).then_some(n);
        let idx = p.ea.go(
            &Op::Send {
                local: Local::Inline(&payload),
                imm,
            },
            SIG,
        );
        p.ea.expect_req(0x0a + (n % 2 == 0) as u8, idx);
        let kind = if imm.is_some() {
            RespKind::SendImm
        } else {
            RespKind::Send
        };
        let from = p.ea.qpn();
        assert_eq!(
            p.eb.recv_cqe(),
            Completion::Resp {
                kind,
                qpn: p.eb.qpn(),
                wqe_counter: n as u16,
                byte_cnt: payload.len() as u32,
                imm,
                remote_qpn: from
            }
        );
        let (slot, a) = recv_slots.pop_front().unwrap();
        let first = (a as usize).min(payload.len());
        assert_eq!(rbuf.read(slot, first), payload[..first]);
        assert_eq!(
            rbuf.read(slot + 64, payload.len() - first),
            payload[first..]
        );
    }
    assert!(rbuf.guards_intact());
    p.eb.expect_quiet(Duration::from_millis(1));
}

fn raw_cqe(cq: &softnic::Cq, slot: usize) -> Cqe64 {
    let mut b = [0u8; 64];
    cq.ring().read(slot * 64, &mut b);
    bytemuck::cast(b)
}

#[test]
fn cq_wraps_over_many_laps_with_both_initial_fills() {
    for (init, fill) in [
        (CqInit::Invalid, OP_OWN_INVALID),
        (CqInit::InvalidOwned, OP_OWN_INVALID_OWNED),
    ] {
        let o = Opts {
            ncqe: 4,
            cq_init: init,
            ..Opts::default()
        };
        let mut p = Pair::with(o.clone(), o);
        for cq in [&p.ea.scq, &p.ea.rcq, &p.eb.scq, &p.eb.rcq] {
            for s in 0..4 {
                assert_eq!(raw_cqe(cq, s).op_own, fill);
            }
        }
        let dst = p.b.buf(64, RW);
        for n in 0..50u32 {
            p.eb.ini.post_recv(&[]).unwrap();
            let op = Op::Write {
                remote: dst.remote(0),
                local: Local::Inline(&n.to_ne_bytes()),
                imm: Some(n),
            };
            let idx = p.ea.go(&op, SIG);
            p.ea.expect_req(0x09, idx);
            let from = p.ea.qpn();
            assert_eq!(
                p.eb.recv_cqe(),
                Completion::Resp {
                    kind: RespKind::WriteImm,
                    qpn: p.eb.qpn(),
                    wqe_counter: n as u16,
                    byte_cnt: 4,
                    imm: Some(n),
                    remote_qpn: from
                }
            );
            // the entries sit at n % 4 with the owner bit of lap n / 4
            for cq in [&p.ea.scq, &p.eb.rcq] {
                let c = raw_cqe(cq, n as usize % 4);
                assert_eq!(c.op_own & 1, ((n / 4) & 1) as u8, "cqe {n}");
                assert!(sw_owns(c.op_own, n, 4));
                assert!(
                    !sw_owns(c.op_own, n + 4, 4),
                    "next lap must not own cqe {n}"
                );
            }
            assert_eq!(dst.u32_at(0), n);
        }
        assert_eq!(p.ea.scq.produced(), 50);
        p.ea.expect_quiet(Duration::from_millis(1));
        p.eb.expect_quiet(Duration::ZERO);
    }
}

#[test]
fn collapsed_cq_writes_every_cqe_to_slot_0() {
    for (ncqe, init, fill) in [
        (1, CqInit::Invalid, OP_OWN_INVALID),
        (4, CqInit::InvalidOwned, OP_OWN_INVALID_OWNED),
    ] {
        let oa = Opts {
            ncqe,
            cq_mode: CqMode::Collapsed,
            cq_init: init,
            ..Opts::default()
        };
        let mut p = Pair::with(oa, Opts::default());
        let dst = p.b.buf(64, RW);
        for n in 0..20u32 {
            let op = Op::Write {
                remote: dst.remote(0),
                local: Local::Inline(&n.to_ne_bytes()),
                imm: None,
            };
            let idx = p.ea.go(&op, SIG);
            p.ea.expect_req(0x08, idx);
            let c = raw_cqe(&p.ea.scq, 0);
            assert_eq!(c.wqe_counter.get(), idx);
            for s in 1..ncqe as usize {
                assert_eq!(raw_cqe(&p.ea.scq, s).op_own, fill, "slot {s} written");
            }
        }
        // several completions before a poll: the newest is what slot 0 shows
        let mut last = 0;
        for _ in 0..3 {
            last = p.ea.post(&Op::Nop, SIG);
        }
        p.ea.ini.ring();
        wait_until("three CQEs", || p.ea.scq.produced() == 23);
        assert_eq!(
            p.ea.send_cqe(),
            Completion::Req {
                wqe_opcode: 0,
                qpn: p.ea.qpn(),
                wqe_counter: last,
                byte_cnt: 0
            }
        );
        assert_eq!(p.ea.ini.poll_send(), None);
        assert_eq!(p.ea.qp.state(), QpState::Rts);
    }
}

#[test]
fn overrun_detect_cq_with_a_consumer_keeping_up() {
    let oa = Opts {
        ncqe: 2,
        cq_mode: CqMode::OverrunDetect,
        ..Opts::default()
    };
    let mut p = Pair::with(oa, Opts::default());
    for _ in 0..30 {
        let i = p.ea.go(&Op::Nop, SIG);
        p.ea.expect_req(0, i);
    }
    assert!(!p.ea.scq.is_overrun());
    assert_eq!(p.ea.qp.state(), QpState::Rts);
    assert_eq!(p.a.dev.counters().cq_overruns, 0);
}

#[test]
fn overrun_detect_cq_overruns_when_the_consumer_index_stays() {
    let oa = Opts {
        ncqe: 4,
        cq_mode: CqMode::OverrunDetect,
        ..Opts::default()
    };
    let mut p = Pair::with(oa, Opts::default());
    let mut idx = Vec::new();
    for _ in 0..5 {
        idx.push(p.ea.post(&Op::Nop, SIG));
    }
    p.ea.ini.ring();
    wait_until("the overrun", || p.ea.scq.is_overrun());
    assert_eq!(p.ea.scq.produced(), 4);
    // the QP goes to ERR right after the CQ refuses the CQE (a thread of a loaded machine may
    // be descheduled in between)
    wait_until("the QP in ERR", || p.ea.qp.state() == QpState::Err);
    assert!(p.a.dev.counters().cq_overruns >= 1);
    // the four CQEs written before the overrun are intact
    for &i in &idx[..4] {
        p.ea.expect_req(0, i);
    }
    // nothing more is written to a CQ in error, even now that the consumer caught up
    p.ea.go(&Op::Nop, SIG);
    p.ea.expect_quiet(Duration::from_millis(5));
    assert_eq!(p.ea.scq.produced(), 4);

    // the responder's receive CQ overruns the same way and its QP goes to ERR
    let ob = Opts {
        ncqe: 2,
        cq_mode: CqMode::OverrunDetect,
        ..Opts::default()
    };
    let mut p = Pair::with(Opts::default(), ob);
    for _ in 0..3 {
        p.eb.ini.post_recv(&[]).unwrap();
    }
    for _ in 0..2 {
        let i = p.ea.go(
            &Op::Send {
                local: Local::Inline(b""),
                imm: None,
            },
            SIG,
        );
        p.ea.expect_req(0x0a, i);
    }
    p.ea.go(
        &Op::Send {
            local: Local::Inline(b""),
            imm: None,
        },
        SIG,
    );
    wait_until("the responder overrun", || p.eb.rcq.is_overrun());
    wait_until("the responder's QP in ERR", || {
        p.eb.qp.state() == QpState::Err
    });
    assert!(p.b.dev.counters().cq_overruns >= 1);
}

/// Writes a whole WQE into BlueFlame half `h` the way a writer must: bytes 8.. first, then
/// the first 8 bytes with release. Sets the DBREC to `pi` first.
fn blueflame_raw(ep: &Ep, dev: &softnic::Device, h: usize, wqe: &[u8], pi: u16) {
    assert!(wqe.len() <= BF_HALF_SIZE);
    ep.set_dbrec(pi);
    ep.qp
        .uar()
        .write(BF_OFFSET + h * BF_HALF_SIZE + 8, &wqe[8..]);
    let first = u64::from_ne_bytes(wqe[..8].try_into().unwrap());
    ep.qp
        .uar()
        .atomic_u64(BF_OFFSET + h * BF_HALF_SIZE)
        .store(first, Ordering::Release);
    dev.kick();
}

#[test]
fn blueflame_executes_the_register_copy_not_the_ring() {
    let oa = Opts {
        doorbell: DoorbellMode::BlueFlame,
        ring: RingMode::BlueFlame,
        max_inline: 512,
        ..Opts::default()
    };
    let mut p = Pair::with(oa, Opts::default());
    let dst = p.b.buf(256, RW);
    for n in 0..6usize {
        // post: the ring and the initiator's copy hold "A…"; then the ring's payload bytes
        // are overwritten with "B…" before the doorbell copies the WQE into the register
        let a = vec![b'A' + n as u8; 100];
        let op = Op::Write {
            remote: dst.remote(0),
            local: Local::Inline(&a),
            imm: None,
        };
        let idx = p.ea.post(&op, SIG);
        let blocks = op.encode(0, 1, SIG).unwrap().blocks();
        assert!(blocks * WQEBB <= BF_HALF_SIZE);
        let mut ring = p.ea.read_ring(idx, blocks);
        for b in &mut ring[36..136] {
            *b = b'b';
        }
        p.ea.overwrite_ring(idx, &ring);
        p.ea.ini.ring();
        p.ea.expect_req(0x08, idx);
        assert_eq!(dst.read(0, 100), a, "lap {n}: the ring copy executed");
        assert_eq!(p.a.dev.counters().bf_run, n as u64 + 1, "lap {n}: counted");
    }
    // the other way round: the register carries a payload the ring does not have
    let a = [b'R'; 40];
    let op = Op::Write {
        remote: dst.remote(128),
        local: Local::Inline(&a),
        imm: None,
    };
    let idx = p.ea.post(&op, SIG);
    let mut reg = op.encode(idx, p.ea.qpn(), SIG).unwrap().as_bytes().to_vec();
    for b in &mut reg[36..76] {
        *b = b'G';
    }
    let h = (0..2).find(|&h| p.ea.reg_value(h).index() != idx).unwrap();
    blueflame_raw(&p.ea, &p.a.dev, h, &reg, idx + 1);
    p.ea.expect_req(0x08, idx);
    assert_eq!(dst.read(128, 40), [b'G'; 40]);
    // earlier WQEs of a batch, and WQEs too large for a register half, run from the ring
    let big = vec![b'Z'; 300];
    let op1 = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(&big[..50]),
        imm: None,
    };
    let i1 = p.ea.post(&op1, UNSIG);
    let mut r = p.ea.read_ring(i1, 1);
    r[36] = b'y';
    p.ea.overwrite_ring(i1, &r);
    let i2 = p.ea.post(&Op::Nop, SIG);
    p.ea.ini.ring();
    p.ea.expect_req(0, i2);
    assert_eq!(
        dst.read(0, 2),
        b"yZ",
        "a non-last WQE of a batch must run from the ring"
    );
    let dst2 = p.b.buf(512, RW);
    let op3 = Op::Write {
        remote: dst2.remote(0),
        local: Local::Inline(&big),
        imm: None,
    };
    let i3 = p.ea.post(&op3, SIG);
    let blocks = op3.encode(0, 1, SIG).unwrap().blocks();
    assert!(blocks * WQEBB > BF_HALF_SIZE);
    let mut r = p.ea.read_ring(i3, blocks);
    r[36] = b'y';
    p.ea.overwrite_ring(i3, &r);
    p.ea.ini.ring();
    p.ea.expect_req(0x08, i3);
    assert_eq!(
        dst2.read(0, 2),
        b"yZ",
        "a WQE larger than a register half must run from the ring"
    );
}

#[test]
fn register_doorbell_executes_the_ring() {
    // the control case of the test above: with 8-byte doorbells the ring is what runs
    let mut p = Pair::new();
    let dst = p.b.buf(256, RW);
    let a = vec![b'A'; 100];
    let op = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(&a),
        imm: None,
    };
    let idx = p.ea.post(&op, SIG);
    let mut ring = p.ea.read_ring(idx, 3);
    for b in &mut ring[36..136] {
        *b = b'b';
    }
    p.ea.overwrite_ring(idx, &ring);
    p.ea.ini.ring();
    p.ea.expect_req(0x08, idx);
    assert_eq!(dst.read(0, 100), [b'b'; 100]);
}

#[test]
fn late_blueflame_copy_of_a_wqe_already_run_is_not_replayed() {
    // The writer updates the DBREC before it copies the WQE into the register; a device that
    // reads the DBREC meanwhile runs the WQE from the ring. The register copy that arrives
    // afterwards must not be kept and replayed when the 16-bit index comes round again.
    let oa = Opts {
        sq_blocks: 1024,
        doorbell: DoorbellMode::BlueFlame,
        ring: RingMode::Doca,
        ..Opts::default()
    };
    let mut p = Pair::with(oa, Opts::default());
    let dst = p.b.buf(64, RW);
    let old = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(b"old"),
        imm: None,
    };
    let idx = p.ea.post(&old, SIG);
    p.ea.ini.ring(); // 8-byte DOCA doorbell on half 0: runs from the ring
    p.ea.expect_req(0x08, idx);
    assert_eq!(dst.read(0, 3), b"old");
    dst.fill(0);
    // the late register copy of the same WQE, on half 1
    let w = old.encode(idx, p.ea.qpn(), SIG).unwrap();
    blueflame_raw(&p.ea, &p.a.dev, 1, w.as_bytes(), idx + 1);
    p.ea.expect_quiet(Duration::from_millis(5));
    assert_eq!(dst.read(0, 3), [0; 3], "a repeated doorbell re-ran a WQE");
    // 65535 blocks of NOPs (raw 16-block ones, unsignaled, then a signaled 1-block one per
    // doorbell) bring the 16-bit index back to `idx`
    let mut left = 65535u32;
    while left > 0 {
        let batch = left.min(1024);
        let mut room = batch - 1;
        while room > 0 {
            let b = if room >= 16 { 16 } else { 1 };
            let pi = p.ea.ini.producer();
            let mut raw = Op::Nop
                .encode(pi, p.ea.qpn(), UNSIG)
                .unwrap()
                .as_bytes()
                .to_vec();
            if b == 16 {
                raw[7] = (raw[7] & !0x3f) | 63;
            }
            raw.resize(b * WQEBB, 0);
            p.ea.post_raw(&raw);
            room -= b as u32;
        }
        let sig = p.ea.post(&Op::Nop, SIG);
        p.ea.ini.ring();
        p.ea.expect_req(0, sig);
        left -= batch;
    }
    assert_eq!(p.ea.ini.producer(), idx);
    let dst2 = p.b.buf(64, RW);
    let new = Op::Write {
        remote: dst2.remote(0),
        local: Local::Inline(b"new"),
        imm: None,
    };
    let nidx = p.ea.post(&new, SIG);
    p.ea.ini.ring();
    p.ea.expect_req(0x08, nidx);
    assert_eq!(
        dst2.read(0, 3),
        b"new",
        "a stale register copy ran instead of the ring"
    );
    assert_eq!(dst.read(0, 3), [0; 3]);
}

#[test]
fn repeated_identical_doorbells_are_no_ops() {
    for mode in [RingMode::RdmaCore, RingMode::Doca] {
        let oa = Opts {
            ring: mode,
            ..Opts::default()
        };
        let mut p = Pair::with(oa, Opts::default());
        let dst = p.b.buf(64, RW);
        let op = Op::Write {
            remote: dst.remote(0),
            local: Local::Inline(b"once"),
            imm: None,
        };
        let idx = p.ea.go(&op, SIG);
        p.ea.expect_req(0x08, idx);
        dst.fill(0);
        let seen = p.a.dev.counters().doorbells_seen;
        // ring the same doorbell again, on both halves, several times (DOCA writers ring
        // twice per post), and the DOCA form of the same producer too
        let same = [
            p.ea.reg_value(0),
            p.ea.reg_value(1),
            DoorbellValue::from_pi(idx + 1, p.ea.qpn()),
        ];
        for _ in 0..3 {
            for v in same {
                if v.qpn() != p.ea.qpn() {
                    continue; // a half never written
                }
                for h in 0..2 {
                    p.ea.ring_raw(&p.a.dev, h, v);
                    std::thread::sleep(Duration::from_micros(300));
                }
            }
        }
        // at least one half ends with a value it did not have: wait until the engine has
        // looked, then give it time to (wrongly) act
        wait_until("the repeated doorbells", || {
            p.a.dev.counters().doorbells_seen > seen
        });
        p.ea.expect_quiet(Duration::from_millis(5));
        assert_eq!(dst.read(0, 4), [0; 4], "a repeated doorbell re-ran a WQE");
        let c = p.a.dev.counters();
        assert_eq!(c.bad_doorbells, 0);
        assert_eq!(c.wqes_executed, 1);
        assert_eq!(p.ea.qp.state(), QpState::Rts);
        // and the queue carries on normally
        let idx2 = p.ea.go(&op, SIG);
        assert_eq!(idx2, idx + 1);
        p.ea.expect_req(0x08, idx2);
        assert_eq!(dst.read(0, 4), b"once");
    }
}
