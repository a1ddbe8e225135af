//! Every error class: the exact error CQE (opcode REQ_ERR / RESP_ERR, syndrome, vendor
//! syndrome, WQE opcode, wqe_counter, qpn), the QP in ERR, and every later WQE flushed with
//! exactly one WR_FLUSH CQE whether signaled or not. Nothing is written outside the
//! registered range (guard bytes) and nothing is written at all by a failing WQE.
//!
//! This file: malformed WQEs, local protection, remote access, the receive side
//! (`errors_peer.rs`: doorbells, a peer gone, fault injection, the rest).

mod common;
mod errors_util;

use common::*;
use errors_util::*;
use prm::wqe::{AtomicSize, Local, Op, RemoteAddr, Sge, INLINE_SEG};
use prm::{Completion, Lkey, Rkey, Syndrome};
use softnic::outcome::vendor;
use softnic::{Access, QpState};
use std::time::Duration;

// ---------------------------------------------------------------- malformed WQEs

#[test]
fn bad_opcode_and_bad_opmod_and_bad_ds_are_local_qp_op() {
    // (bytes patcher, WQE opcode in the CQE)
    type Patch = fn(&mut Vec<u8>);
    let cases: [(&str, Patch, u8); 6] = [
        ("unknown opcode 0x1b", |b| b[3] = 0x1b, 0x1b),
        ("unknown opcode 0x02", |b| b[3] = 0x02, 0x02),
        ("opmod on a WRITE", |b| b[0] = 3, 0x08),
        ("ds 1 for a WRITE", |b| b[7] = (b[7] & !0x3f) | 1, 0x08),
        ("ds 0", |b| b[7] &= !0x3f, 0x08),
        (
            "ds 3 for an ATOMIC_FA",
            |b| {
                b[3] = 0x12;
                b[7] = (b[7] & !0x3f) | 3
            },
            0x12,
        ),
    ];
    for (what, patch, opcode) in cases {
        let mut fx = Fx::new();
        fx.warm_up();
        let w = Op::Write {
            remote: fx.dst.remote(0),
            local: Local::Inline(b"0123456789ab"),
            imm: None,
        }
        .encode(fx.p.ea.ini.producer(), fx.p.ea.qpn(), UNSIG)
        .unwrap();
        // one block, so every patched ds still spans the one block that was posted
        assert_eq!(w.blocks(), 1);
        let mut bytes = w.as_bytes().to_vec();
        patch(&mut bytes);
        let idx = fx.p.ea.post_raw(&bytes);
        let after = fx.trailers();
        fx.p.ea.ini.ring();
        let want = prm::ErrorCqe {
            responder: false,
            syndrome: Syndrome::LocalQpOp as u8,
            vendor_syndrome: vendor::MALFORMED_WQE,
            wqe_opcode: opcode,
            qpn: fx.p.ea.qpn(),
            wqe_counter: idx,
        };
        assert_eq!(fx.p.ea.send_cqe(), Completion::Error(want), "{what}");
        for (o, i) in after {
            fx.p.ea.expect_flush(o, i);
        }
        fx.p.ea.expect_flushes_after(2);
        fx.untouched();
        assert_eq!(
            fx.p.eb.qp.state(),
            QpState::Rts,
            "local error moved the responder"
        );
    }
}

#[test]
fn wqe_qpn_mismatch_is_local_qp_op() {
    let mut fx = Fx::new();
    fx.warm_up();
    let w = Op::Nop
        .encode(fx.p.ea.ini.producer(), fx.p.ea.qpn() + 1, SIG)
        .unwrap();
    let idx = fx.p.ea.post_raw(w.as_bytes());
    fx.p.ea.ini.ring();
    fx.p.ea
        .expect_err(Syndrome::LocalQpOp, vendor::WQE_QPN, 0, idx);
    fx.p.ea.expect_flushes_after(2);
}

#[test]
fn wqe_index_not_its_ring_position_is_stale() {
    for wrong in [64u16, 1, 0x8000] {
        let mut fx = Fx::new();
        fx.warm_up();
        let pi = fx.p.ea.ini.producer();
        // the same slot one lap later (64-block ring), or another slot, or far away
        let w = Op::Write {
            remote: fx.dst.remote(0),
            local: Local::Inline(b"stale"),
            imm: None,
        }
        .encode(pi.wrapping_add(wrong), fx.p.ea.qpn(), SIG)
        .unwrap();
        let idx = fx.p.ea.post_raw(w.as_bytes());
        assert_eq!(idx, pi);
        let after = fx.trailers();
        fx.p.ea.ini.ring();
        fx.p.ea
            .expect_err(Syndrome::LocalQpOp, vendor::STALE_WQE, 0x08, idx);
        for (o, i) in after {
            fx.p.ea.expect_flush(o, i);
        }
        fx.p.ea.expect_flushes_after(2);
        fx.untouched();
        assert_eq!(fx.p.a.dev.counters().stale_wqes, 1);
    }
}

#[test]
fn wqe_longer_than_the_producer_index() {
    let mut fx = Fx::new();
    fx.warm_up();
    // a 1-block slot whose ds claims 3 blocks; only 1 block was announced
    let sges = [fx.src.sge(0, 1); 8];
    let w = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Sges(&sges),
        imm: None,
    }
    .encode(fx.p.ea.ini.producer(), fx.p.ea.qpn(), SIG)
    .unwrap();
    assert_eq!(w.blocks(), 3);
    let idx = fx.p.ea.post_raw(&w.as_bytes()[..64]);
    fx.p.ea.ini.ring();
    fx.p.ea
        .expect_err(Syndrome::LocalQpOp, vendor::WQE_PAST_PRODUCER, 0x08, idx);
    // the device must not run past what was announced (no flood of flushes of garbage)
    fx.p.ea.expect_quiet(Duration::from_millis(10));
    fx.p.ea.expect_flushes_after(3);
    fx.p.ea.expect_quiet(Duration::from_millis(5));
    fx.untouched();
}

#[test]
fn inline_longer_than_max_inline_is_local_length() {
    let oa = Opts {
        max_inline: 64,
        ..Opts::default()
    };
    let mut fx = Fx::with(oa, Opts::default());
    let data = [0x77u8; 65];
    // exactly max_inline is fine
    let ok = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Inline(&data[..64]),
        imm: None,
    };
    let i = fx.p.ea.go(&ok, SIG);
    fx.p.ea.expect_req(0x08, i);
    assert_eq!(fx.dst.read(0, 64), [0x77; 64]);
    let op = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Inline(&data),
        imm: None,
    };
    fx.fails(&op, Syndrome::LocalLength, vendor::TOO_LONG);
    // same for a SEND
    let mut fx = Fx::with(
        Opts {
            max_inline: 64,
            ..Opts::default()
        },
        Opts::default(),
    );
    let op = Op::Send {
        local: Local::Inline(&data),
        imm: None,
    };
    fx.fails(&op, Syndrome::LocalLength, vendor::TOO_LONG);
}

#[test]
fn inline_count_not_matching_ds_is_local_length_or_a_next_segment() {
    for (len, claimed) in [(20u32, 40u32), (40, 20), (12, 13)] {
        let mut fx = Fx::new();
        fx.warm_up();
        let data = vec![0x33u8; len as usize];
        let w = Op::Send {
            local: Local::Inline(&data),
            imm: None,
        }
        .encode(fx.p.ea.ini.producer(), fx.p.ea.qpn(), UNSIG)
        .unwrap();
        let mut b = w.as_bytes().to_vec();
        b[16..20].copy_from_slice(&(claimed | INLINE_SEG).to_be_bytes());
        let same_units = (4 + len).div_ceil(16) == (4 + claimed).div_ceil(16);
        let idx = fx.p.ea.post_raw(&b);
        fx.p.eb.ini.post_recv(&[]).ok();
        fx.p.ea.ini.ring();
        if same_units {
            // a count that still fits the units the WQE spends is a valid shorter message;
            // it needs a receive with room: the empty receive is too small
            fx.p.ea
                .expect_err(Syndrome::RemoteInvalReq, vendor::RECV_BUFFER, 0x0a, idx);
        } else if claimed < len {
            // an inline segment that ends before ds: the units after it are the next data
            // segment (segments are read in order, inline and pointer ones mixed); here the
            // inline bytes read as a pointer segment with key 0x33333333: no such lkey
            fx.p.ea
                .expect_err(Syndrome::LocalProt, vendor::LOCAL_KEY, 0x0a, idx);
        } else {
            fx.p.ea
                .expect_err(Syndrome::LocalLength, vendor::MALFORMED_WQE, 0x0a, idx);
        }
        fx.p.ea.expect_flushes_after(2);
    }
}

#[test]
fn atomic_result_buffer_of_wrong_size_is_local_length() {
    for (size, len) in [
        (None, 4u32),
        (None, 16),
        (Some(AtomicSize::B4), 8),
        (Some(AtomicSize::B8), 4),
    ] {
        let mut fx = Fx::new();
        let result = fx.res.sge(0, len);
        let remote = fx.dst.remote(64);
        let op = match size {
            None => Op::FetchAdd {
                remote,
                add: 1,
                result,
            },
            Some(size) => Op::MaskedFetchAdd {
                size,
                remote,
                add: 1,
                field_boundary: 0,
                result,
            },
        };
        fx.fails(&op, Syndrome::LocalLength, vendor::MALFORMED_WQE);
        assert!(fx.res.bytes().iter().all(|&b| b == 0));
    }
}

// ---------------------------------------------------------------- local protection

#[test]
fn bad_lkey_local_range_and_wrong_pd_are_local_prot() {
    // bad key
    let mut fx = Fx::new();
    let sges = [
        fx.src.sge(0, 8),
        Sge {
            addr: fx.src.addr(8),
            len: 8,
            lkey: Lkey(bad_key()),
        },
    ];
    let op = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Sges(&sges),
        imm: None,
    };
    fx.fails(&op, Syndrome::LocalProt, vendor::LOCAL_KEY);

    // range: one byte past the end, one byte before the start, and a zero byte count
    // (which means 2 GiB)
    for (off, len) in [(4000i64, 97u32), (-1, 8), (0, 0)] {
        let mut fx = Fx::new();
        let s = Sge {
            addr: (fx.src.addr(0) as i64 + off) as u64,
            len,
            lkey: fx.src.lkey(),
        };
        let op = Op::Send {
            local: Local::Sges(&[s]),
            imm: None,
        };
        fx.p.eb.ini.post_recv(&[]).unwrap();
        fx.fails(&op, Syndrome::LocalProt, vendor::LOCAL_KEY);
        // the receive was not consumed by a request that never left
        assert_eq!(fx.p.eb.ini.poll_recv(), None);
    }

    // wrong PD: a region of A's device in another protection domain
    let mut fx = Fx::new();
    let other_pd = fx.p.a.dev.alloc_pd();
    let other = Buf::new(&fx.p.a.dev, other_pd, 64, Access::LOCAL_WRITE);
    let op = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Sges(&[other.sge(0, 8)]),
        imm: None,
    };
    fx.fails(&op, Syndrome::LocalProt, vendor::LOCAL_KEY);

    // a READ into a region without LOCAL_WRITE, an atomic result likewise
    let mut fx = Fx::new();
    let op = Op::Read {
        remote: fx.dst.remote(0),
        local: &[fx.src.sge(0, 8)],
    };
    fx.fails(&op, Syndrome::LocalProt, vendor::LOCAL_KEY);
    assert!(fx.src.bytes().iter().all(|&b| b == 0x11));
    let mut fx = Fx::new();
    let op = Op::FetchAdd {
        remote: fx.dst.remote(0),
        add: 1,
        result: fx.src.sge(0, 8),
    };
    fx.fails(&op, Syndrome::LocalProt, vendor::LOCAL_KEY);
    // a READ whose destination runs past its region: nothing lands in the guard
    let mut fx = Fx::new();
    fx.dst.fill(0);
    let op = Op::Read {
        remote: fx.dst.remote(0),
        local: &[fx.res.sge(32, 33)],
    };
    fx.fails(&op, Syndrome::LocalProt, vendor::LOCAL_KEY);
    assert!(fx.res.bytes().iter().all(|&b| b == 0));
}

// ---------------------------------------------------------------- remote access

/// Expects REMOTE_ACCESS at the requester and the responder in ERR.
fn remote_fails(fx: &mut Fx, op: &Op<'_>) {
    fx.fails(op, Syndrome::RemoteAccess, vendor::REMOTE_KEY);
    assert_eq!(fx.p.eb.qp.state(), QpState::Err, "responder not in ERR");
}

#[test]
fn bad_rkey_remote_range_missing_right_are_remote_access() {
    let src_sge = |fx: &Fx| [fx.src.sge(0, 64)];
    // bad rkey
    let mut fx = Fx::new();
    let s = src_sge(&fx);
    let op = Op::Write {
        remote: RemoteAddr {
            addr: fx.dst.addr(0),
            rkey: Rkey(bad_key()),
        },
        local: Local::Sges(&s),
        imm: None,
    };
    remote_fails(&mut fx, &op);
    // remote range: the last byte lands one past the region (guard untouched), and below it
    for off in [4096 - 63, usize::MAX] {
        let mut fx = Fx::new();
        let s = src_sge(&fx);
        let addr = if off == usize::MAX {
            fx.dst.addr(0) - 1
        } else {
            fx.dst.addr(off)
        };
        let op = Op::Write {
            remote: RemoteAddr {
                addr,
                rkey: fx.dst.rkey(),
            },
            local: Local::Sges(&s),
            imm: None,
        };
        remote_fails(&mut fx, &op);
    }
    // READ past the end of the remote region
    let mut fx = Fx::new();
    let op = Op::Read {
        remote: fx.dst.remote(4090),
        local: &[fx.res.sge(0, 8)],
    };
    remote_fails(&mut fx, &op);
    assert!(fx.res.bytes().iter().all(|&b| b == 0));
    // an rkey of A's own device used as if it were B's: unknown at B (keys are per device)
    let mut fx = Fx::new();
    let own = fx.p.a.buf(64, ALL_REMOTE);
    let s = src_sge(&fx);
    let op = Op::Write {
        remote: RemoteAddr {
            addr: own.addr(0),
            rkey: Rkey(own.mr.key | 0xff0000),
        },
        local: Local::Sges(&s),
        imm: None,
    };
    remote_fails(&mut fx, &op);
    assert!(own.bytes().iter().all(|&b| b == 0));
}

#[test]
fn missing_region_rights_are_remote_access() {
    let rights_without = |r: Access| Access(ALL_REMOTE.0 & !r.0);
    for missing in [
        Access::REMOTE_WRITE,
        Access::REMOTE_READ,
        Access::REMOTE_ATOMIC,
    ] {
        let mut fx = Fx::new();
        let t = fx.p.b.buf(64, rights_without(missing));
        let s = [fx.src.sge(0, 8)];
        let op = if missing == Access::REMOTE_WRITE {
            Op::Write {
                remote: t.remote(0),
                local: Local::Sges(&s),
                imm: None,
            }
        } else if missing == Access::REMOTE_READ {
            Op::Read {
                remote: t.remote(0),
                local: &[fx.res.sge(0, 8)],
            }
        } else {
            Op::CompareSwap {
                remote: t.remote(0),
                compare: 0,
                swap: 9,
                result: fx.res.sge(0, 8),
            }
        };
        remote_fails(&mut fx, &op);
        assert!(t.bytes().iter().all(|&b| b == 0) && t.guards_intact());
        assert!(fx.res.bytes().iter().all(|&b| b == 0));
    }
}

#[test]
fn missing_qp_access_flags_are_remote_access() {
    for missing in [
        Access::REMOTE_WRITE,
        Access::REMOTE_READ,
        Access::REMOTE_ATOMIC,
    ] {
        let ob = Opts {
            access: Access(Opts::default().access.0 & !missing.0),
            ..Opts::default()
        };
        let mut fx = Fx::with(Opts::default(), ob);
        let s = [fx.src.sge(0, 8)];
        let op = if missing == Access::REMOTE_WRITE {
            // the warm-up write needs REMOTE_WRITE, so use an IMM write's sibling: plain write
            Op::Write {
                remote: fx.dst.remote(0),
                local: Local::Sges(&s),
                imm: None,
            }
        } else if missing == Access::REMOTE_READ {
            Op::Read {
                remote: fx.dst.remote(0),
                local: &[fx.res.sge(0, 8)],
            }
        } else {
            Op::FetchAdd {
                remote: fx.dst.remote(0),
                add: 1,
                result: fx.res.sge(0, 8),
            }
        };
        if missing == Access::REMOTE_WRITE {
            // no warm-up possible; the first WQE fails at counter 0
            let idx = fx.p.ea.go(&op, UNSIG);
            assert_eq!(idx, 0);
            fx.p.ea
                .expect_err(Syndrome::RemoteAccess, vendor::REMOTE_KEY, 0x08, 0);
            fx.p.ea.expect_flushes_after(2);
            fx.untouched();
            assert_eq!(fx.p.eb.qp.state(), QpState::Err);
        } else {
            remote_fails(&mut fx, &op);
        }
    }
}

#[test]
fn responder_in_err_flushes_its_posted_receives() {
    let mut fx = Fx::new();
    let rbuf = fx.p.b.buf(64, softnic::Access::LOCAL_WRITE);
    let r0 = fx.p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
    let r1 = fx.p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
    let s = [fx.src.sge(0, 8)];
    let op = Op::Write {
        remote: fx.dst.remote(4095),
        local: Local::Sges(&s),
        imm: None,
    };
    remote_fails(&mut fx, &op);
    fx.p.eb.expect_recv_err(Syndrome::WrFlush, 0, r0);
    fx.p.eb.expect_recv_err(Syndrome::WrFlush, 0, r1);
    // a receive posted later flushes too
    let r2 = fx.p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
    fx.p.eb.expect_recv_err(Syndrome::WrFlush, 0, r2);
    fx.p.eb.expect_quiet(Duration::from_millis(2));
    assert!(rbuf.bytes().iter().all(|&b| b == 0));
}

#[test]
fn misaligned_atomic_is_remote_inval_req() {
    type MakeOp = fn(RemoteAddr, Sge) -> Op<'static>;
    let kinds: [(u32, MakeOp); 4] = [
        (8, |remote, result| Op::FetchAdd {
            remote,
            add: 1,
            result,
        }),
        (8, |remote, result| Op::CompareSwap {
            remote,
            compare: 0,
            swap: 1,
            result,
        }),
        (4, |remote, result| Op::MaskedFetchAdd {
            size: AtomicSize::B4,
            remote,
            add: 1,
            field_boundary: 0,
            result,
        }),
        (8, |remote, result| Op::MaskedCompareSwap {
            size: AtomicSize::B8,
            remote,
            compare: 0,
            compare_mask: 0,
            swap: 1,
            swap_mask: 1,
            result,
        }),
    ];
    for (size, mk) in kinds {
        for off in [1usize, 2, size as usize / 2 + 1] {
            let mut fx = Fx::new();
            let op = mk(fx.dst.remote(64 + off), fx.res.sge(0, size));
            fx.fails(&op, Syndrome::RemoteInvalReq, vendor::INVALID_REQUEST);
            assert_eq!(fx.p.eb.qp.state(), QpState::Err);
            assert!(fx.res.bytes().iter().all(|&b| b == 0));
        }
    }
    // a 4-byte masked atomic at a 4-aligned (not 8-aligned) address is fine
    let mut fx = Fx::new();
    let op = Op::MaskedFetchAdd {
        size: AtomicSize::B4,
        remote: fx.dst.remote(68),
        add: 3,
        field_boundary: 0,
        result: fx.res.sge(4, 4),
    };
    let i = fx.p.ea.go(&op, SIG);
    assert_eq!(fx.p.ea.expect_req(0x15, i), 4);
    assert_eq!(fx.dst.u32_at(68), 3);
}

// ---------------------------------------------------------------- receive side

#[test]
fn send_without_receive_exhausts_rnr_retries() {
    let oa = Opts {
        rts: softnic::RtsAttr {
            rnr_retry: 3,
            ..Opts::default().rts
        },
        ..Opts::default()
    };
    let mut fx = Fx::with(oa, Opts::default());
    fx.warm_up();
    let op = Op::Send {
        local: Local::Sges(&[fx.src.sge(0, 16)]),
        imm: None,
    };
    let idx = fx.p.ea.post(&op, SIG);
    let after = fx.trailers();
    fx.p.ea.ini.ring();
    fx.p.ea
        .expect_err(Syndrome::RnrRetryExc, vendor::RNR, 0x0a, idx);
    for (o, i) in after {
        fx.p.ea.expect_flush(o, i);
    }
    fx.p.ea.expect_flushes_after(2);
    // RNR is not the responder's error
    assert_eq!(fx.p.eb.qp.state(), QpState::Rts);
    fx.untouched();
    // rnr_retry 0: the first RNR NAK fails; a WRITE_IMM needs a receive too
    let oa = Opts {
        rts: softnic::RtsAttr {
            rnr_retry: 0,
            ..Opts::default().rts
        },
        ..Opts::default()
    };
    let mut fx = Fx::with(oa, Opts::default());
    let op = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Inline(b"x"),
        imm: Some(1),
    };
    fx.fails(&op, Syndrome::RnrRetryExc, vendor::RNR);
    assert_eq!(fx.p.eb.qp.state(), QpState::Rts);
}

#[test]
fn rnr_retry_7_waits_for_a_late_receive() {
    let mut fx = Fx::new(); // rnr_retry 7 (infinite), min_rnr_timer 1 (10 µs)
    let rbuf = fx.p.b.buf(64, Access::LOCAL_WRITE);
    let op = Op::Send {
        local: Local::Inline(b"late receive"),
        imm: Some(77),
    };
    let idx = fx.p.ea.go(&op, SIG);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(fx.p.ea.ini.poll_send(), None, "completed without a receive");
    let r = fx.p.eb.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
    fx.p.ea.expect_req(0x0b, idx);
    let from = fx.p.ea.qpn();
    assert_eq!(
        fx.p.eb.recv_cqe(),
        Completion::Resp {
            kind: prm::cqe::RespKind::SendImm,
            qpn: fx.p.eb.qpn(),
            wqe_counter: r,
            byte_cnt: 12,
            imm: Some(77),
            remote_qpn: from
        }
    );
    assert_eq!(rbuf.read(0, 12), b"late receive");
    assert_eq!(fx.p.ea.qp.state(), QpState::Rts);
}

#[test]
fn receive_buffer_too_small() {
    let mut fx = Fx::new();
    let rbuf = fx.p.b.buf(64, Access::LOCAL_WRITE);
    let ok =
        fx.p.eb
            .ini
            .post_recv(&[rbuf.sge(0, 8), rbuf.sge(16, 8)])
            .unwrap();
    let small =
        fx.p.eb
            .ini
            .post_recv(&[rbuf.sge(0, 8), rbuf.sge(16, 8)])
            .unwrap();
    let later = fx.p.eb.ini.post_recv(&[rbuf.sge(32, 32)]).unwrap();
    // 16 bytes fit exactly
    let i = fx.p.ea.go(
        &Op::Send {
            local: Local::Sges(&[fx.src.sge(0, 16)]),
            imm: None,
        },
        SIG,
    );
    fx.p.ea.expect_req(0x0a, i);
    let from = fx.p.ea.qpn();
    assert_eq!(
        fx.p.eb.recv_cqe(),
        Completion::Resp {
            kind: prm::cqe::RespKind::Send,
            qpn: fx.p.eb.qpn(),
            wqe_counter: ok,
            byte_cnt: 16,
            imm: None,
            remote_qpn: from
        }
    );
    assert_eq!(rbuf.read(0, 8), [0x11; 8]);
    assert_eq!(rbuf.read(16, 8), [0x11; 8]);
    rbuf.fill(0);
    // 17 do not
    let op = Op::Send {
        local: Local::Sges(&[fx.src.sge(0, 17)]),
        imm: None,
    };
    fx.fails(&op, Syndrome::RemoteInvalReq, vendor::RECV_BUFFER);
    fx.p.eb
        .expect_recv_err(Syndrome::LocalLength, vendor::RECV_BUFFER, small);
    fx.p.eb.expect_recv_err(Syndrome::WrFlush, 0, later);
    assert_eq!(fx.p.eb.qp.state(), QpState::Err);
    assert!(
        rbuf.bytes().iter().all(|&b| b == 0),
        "partial receive written"
    );
    assert!(rbuf.guards_intact());
}

#[test]
fn receive_with_bad_key_is_remote_op() {
    let mut fx = Fx::new();
    let r =
        fx.p.eb
            .ini
            .post_recv(&[Sge {
                addr: 0x1000,
                len: 64,
                lkey: Lkey(bad_key()),
            }])
            .unwrap();
    let op = Op::Send {
        local: Local::Inline(b"hello"),
        imm: None,
    };
    fx.fails(&op, Syndrome::RemoteOp, vendor::RECV_BUFFER);
    fx.p.eb
        .expect_recv_err(Syndrome::LocalProt, vendor::RECV_BUFFER, r);
    assert_eq!(fx.p.eb.qp.state(), QpState::Err);
}
