//! Unit tests of the WQE/CQE parser.

extern crate std;
use super::*;
use crate::endian::{Lkey, Rkey};
use crate::wqe::{Local, Op};
use std::vec::Vec;

const R: RemoteAddr = RemoteAddr {
    addr: 0x7000_0000,
    rkey: Rkey(0xabc),
};

fn sge(addr: u64, len: u32) -> Sge {
    Sge {
        addr,
        len,
        lkey: Lkey(9),
    }
}

fn round_trip(op: Op<'_>) {
    let flags = CtrlFlags::SIGNALED;
    let w = op.encode(0x1234, 0x1a2, flags).unwrap();
    let p = parse_wqe(w.as_bytes()).unwrap();
    assert_eq!((p.opcode, p.opmod), op.opcode());
    assert_eq!(p.wqe_index, 0x1234);
    assert_eq!(p.qpn, 0x1a2);
    assert_eq!(p.flags, flags);
    assert_eq!(p.ds, w.ds());
    let same_local = |a: &Local<'_>, b: &ParsedLocal<'_>| match (a, b) {
        (Local::Inline(x), ParsedLocal::Inline(y)) => x == y,
        (Local::Sges(x), ParsedLocal::Sges(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(s, d)| *s == d.sge())
        }
        _ => false,
    };
    match (op, p.op) {
        (Op::Nop, ParsedOp::Nop) => {}
        (
            Op::Write { remote, local, imm },
            ParsedOp::Write {
                remote: r2,
                local: l2,
            },
        ) => {
            assert_eq!(remote, r2);
            assert!(same_local(&local, &l2));
            assert_eq!(imm, p.imm());
        }
        (Op::Send { local, imm }, ParsedOp::Send { local: l2 }) => {
            assert!(same_local(&local, &l2));
            assert_eq!(imm, p.imm());
        }
        (
            Op::Read { remote, local },
            ParsedOp::Read {
                remote: r2,
                local: l2,
            },
        ) => {
            assert_eq!(remote, r2);
            assert!(same_local(&Local::Sges(local), &ParsedLocal::Sges(l2)));
        }
        (
            Op::FetchAdd {
                remote,
                add,
                result,
            },
            ParsedOp::Atomic {
                remote: r2,
                kind,
                result: s2,
            },
        ) => {
            assert_eq!((remote, result), (r2, s2));
            assert_eq!(kind, AtomicKind::FetchAdd { add });
        }
        (
            Op::CompareSwap {
                remote,
                compare,
                swap,
                result,
            },
            ParsedOp::Atomic {
                remote: r2,
                kind,
                result: s2,
            },
        ) => {
            assert_eq!((remote, result), (r2, s2));
            assert_eq!(kind, AtomicKind::CompareSwap { compare, swap });
        }
        (
            Op::MaskedFetchAdd {
                size,
                remote,
                add,
                field_boundary,
                result,
            },
            ParsedOp::Atomic {
                remote: r2,
                kind,
                result: s2,
            },
        ) => {
            assert_eq!((remote, result), (r2, s2));
            assert_eq!(
                kind,
                AtomicKind::MaskedFetchAdd {
                    size,
                    add,
                    field_boundary
                }
            );
        }
        (
            Op::MaskedCompareSwap {
                size,
                remote,
                compare,
                compare_mask,
                swap,
                swap_mask,
                result,
            },
            ParsedOp::Atomic {
                remote: r2,
                kind,
                result: s2,
            },
        ) => {
            assert_eq!((remote, result), (r2, s2));
            assert_eq!(
                kind,
                AtomicKind::MaskedCompareSwap {
                    size,
                    compare,
                    compare_mask,
                    swap,
                    swap_mask
                }
            );
        }
        (
            Op::Wait { cqn, max_index },
            ParsedOp::Wait {
                cqn: c2,
                max_index: m2,
            },
        ) => {
            assert_eq!((cqn, max_index), (c2, m2));
        }
        (Op::Dump { local }, ParsedOp::Dump { local: l2 }) => assert_eq!(local, l2),
        (a, b) => panic!("{a:?} parsed as {b:?}"),
    }
}

#[test]
fn every_op_round_trips() {
    let sges = [sge(0x10, 3), sge(0x20, 4), sge(0x30, 5), sge(0x40, 6)];
    let payload = [7u8; 100];
    for n in 0..=4 {
        for imm in [None, Some(0xfeed)] {
            round_trip(Op::Write {
                remote: R,
                local: Local::Sges(&sges[..n]),
                imm,
            });
            round_trip(Op::Send {
                local: Local::Sges(&sges[..n]),
                imm,
            });
        }
        round_trip(Op::Read {
            remote: R,
            local: &sges[..n],
        });
    }
    for len in [0, 1, 12, 13, 60, 100] {
        round_trip(Op::Write {
            remote: R,
            local: Local::Inline(&payload[..len]),
            imm: None,
        });
        round_trip(Op::Send {
            local: Local::Inline(&payload[..len]),
            imm: Some(1),
        });
    }
    round_trip(Op::Nop);
    let r8 = sge(0x80, 8);
    round_trip(Op::FetchAdd {
        remote: R,
        add: 5,
        result: r8,
    });
    round_trip(Op::CompareSwap {
        remote: R,
        compare: 1,
        swap: 2,
        result: r8,
    });
    for (size, result) in [(AtomicSize::B4, sge(0x80, 4)), (AtomicSize::B8, r8)] {
        round_trip(Op::MaskedFetchAdd {
            size,
            remote: R,
            add: 0x0101,
            field_boundary: 0x8080,
            result,
        });
        round_trip(Op::MaskedCompareSwap {
            size,
            remote: R,
            compare: 3,
            compare_mask: 0xff,
            swap: 4,
            swap_mask: 0xf0,
            result,
        });
    }
    round_trip(Op::Wait {
        cqn: 7,
        max_index: 99,
    });
    round_trip(Op::Dump {
        local: Sge {
            addr: 0x1000,
            len: 64,
            lkey: Lkey(0x1234),
        },
    });
}

#[test]
fn dump_is_ctrl_plus_one_data_segment() {
    let local = Sge {
        addr: 0x1122_3344_5566_7788,
        len: 4096,
        lkey: Lkey(0xabcd),
    };
    let w = Op::Dump { local }
        .encode(5, 0x42, CtrlFlags::SIGNALED)
        .unwrap();
    let b = w.as_bytes();
    assert_eq!(w.ds(), 2);
    assert_eq!(&b[0..4], &(5u32 << 8 | 0x23).to_be_bytes());
    assert_eq!(&b[4..8], &(0x42u32 << 8 | 2).to_be_bytes());
    assert_eq!(&b[16..20], &4096u32.to_be_bytes());
    assert_eq!(&b[20..24], &0xabcdu32.to_be_bytes());
    assert_eq!(&b[24..32], &0x1122_3344_5566_7788u64.to_be_bytes());
    // wrong sizes and inline data are malformed
    let mut three = [0u8; 128];
    three[..32].copy_from_slice(&b[..32]);
    three[7] = 3;
    assert!(matches!(
        parse_wqe(&three),
        Err(WqeError::BadShape {
            opcode: 0x23,
            ds: 3
        })
    ));
    let mut inl = [0u8; 128];
    inl[..32].copy_from_slice(&b[..32]);
    inl[16..20].copy_from_slice(&(0x8000_0008u32).to_be_bytes());
    assert!(matches!(
        parse_wqe(&inl),
        Err(WqeError::InlineNotAllowed { opcode: 0x23 })
    ));
}

fn raw(opcode: u32, opmod: u32, ds: u32) -> [u8; 128] {
    let mut b = [0u8; 128];
    b[0..4].copy_from_slice(&(opmod << 24 | opcode).to_be_bytes());
    b[4..8].copy_from_slice(&(0x55 << 8 | ds).to_be_bytes());
    b
}

#[test]
fn malformed_wqes_map_to_syndromes() {
    let cases: [([u8; 128], WqeError); 6] = [
        (raw(0x08, 0, 0), WqeError::ZeroDs),
        (raw(0x1b, 0, 1), WqeError::UnknownOpcode(0x1b)),
        (
            raw(0x08, 3, 2),
            WqeError::BadOpmod {
                opcode: 8,
                opmod: 3,
            },
        ),
        (
            raw(0x14, 0, 4),
            WqeError::BadOpmod {
                opcode: 0x14,
                opmod: 0,
            },
        ),
        (raw(0x08, 0, 1), WqeError::BadShape { opcode: 8, ds: 1 }),
        (
            raw(0x12, 0, 3),
            WqeError::BadShape {
                opcode: 0x12,
                ds: 3,
            },
        ),
    ];
    for (bytes, err) in cases {
        assert_eq!(parse_wqe(&bytes), Err(err));
        assert_eq!(err.syndrome(), Syndrome::LocalQpOp);
    }
    // inline count that disagrees with ds
    let mut b = raw(0x0a, 0, 2);
    b[16..20].copy_from_slice(&(40u32 | INLINE_SEG).to_be_bytes());
    let e = parse_wqe(&b).unwrap_err();
    assert_eq!(e, WqeError::InlineLength { len: 40, units: 1 });
    assert_eq!(e.syndrome(), Syndrome::LocalLength);
    // atomic with a 4-byte result buffer
    let w = Op::FetchAdd {
        remote: R,
        add: 1,
        result: sge(0, 4),
    }
    .encode(0, 1, CtrlFlags::default())
    .unwrap();
    assert_eq!(
        parse_wqe(w.as_bytes()).unwrap_err(),
        WqeError::AtomicLength { len: 4, size: 8 }
    );
    // ds longer than the bytes given
    assert!(matches!(
        parse_wqe(&raw(0x08, 0, 9)),
        Err(WqeError::Truncated { .. })
    ));
}

#[test]
fn zero_byte_count_means_two_gib() {
    let w = Op::Send {
        local: Local::Sges(&[sge(0, 0)]),
        imm: None,
    }
    .encode(0, 1, CtrlFlags::default())
    .unwrap();
    let p = parse_wqe(w.as_bytes()).unwrap();
    let ParsedOp::Send { local } = p.op else {
        panic!()
    };
    assert_eq!(local.len(), ZERO_BYTE_COUNT_LEN as u64);
}

/// A UMR WQE laid out as libmlx5's `set_bind_wr` writes it: control, UMR control, mkey
/// context and (for a bind) one inline KLM padded to 64 bytes.
fn umr_bytes(key: u32, qpn_mkey: u32, bind: Option<(u64, u64, u32)>, flags: u8) -> Vec<u8> {
    use crate::wqe::{KlmSeg, MkeyContextSeg, UmrCtrlSeg, MKEY_ACCESS_REMOTE_WRITE};
    let units = if bind.is_some() { 12u32 } else { 8 };
    let ctrl = CtrlSeg {
        opmod_idx_opcode: Be32::new(7 << 8 | Opcode::Umr as u32),
        qpn_ds: Be32::new(0x1a2 << 8 | units),
        imm: Be32::new(key),
        ..CtrlSeg::default()
    };
    let mut umr = UmrCtrlSeg {
        flags: flags | UMR_FLAG_INLINE,
        ..UmrCtrlSeg::default()
    };
    let mut mkey = MkeyContextSeg {
        qpn_mkey: Be32::new(qpn_mkey),
        ..MkeyContextSeg::default()
    };
    let mut out = bytemuck::bytes_of(&ctrl).to_vec();
    match bind {
        Some((addr, len, lkey)) => {
            umr.mkey_mask = crate::endian::Be64::new(UMR_MASK_LEN);
            umr.klm_octowords = crate::endian::Be16::new(4);
            mkey.access_flags = MKEY_ACCESS_REMOTE_WRITE;
            mkey.start_addr = crate::endian::Be64::new(addr);
            mkey.len = crate::endian::Be64::new(len);
            out.extend_from_slice(bytemuck::bytes_of(&umr));
            out.extend_from_slice(bytemuck::bytes_of(&mkey));
            let klm = KlmSeg {
                byte_count: Be32::new(len as u32),
                mkey: Be32::new(lkey),
                address: crate::endian::Be64::new(addr),
            };
            out.extend_from_slice(bytemuck::bytes_of(&klm));
            out.resize(out.len() + 48, 0);
        }
        None => {
            mkey.free = MKEY_FREE;
            out.extend_from_slice(bytemuck::bytes_of(&umr));
            out.extend_from_slice(bytemuck::bytes_of(&mkey));
        }
    }
    assert_eq!(out.len(), units as usize * DS_UNIT);
    out
}

#[test]
fn memory_window_binds_and_frees() {
    let b = umr_bytes(
        0x300,
        0x1a2 << 8 | 0x05,
        Some((0x9000, 256, 0x201)),
        UMR_FLAG_CHECK_FREE,
    );
    let p = parse_wqe(&b).unwrap();
    assert_eq!(p.opcode, Opcode::Umr);
    let ParsedOp::Umr(u) = p.op else {
        panic!("{:?}", p.op)
    };
    assert_eq!(
        u.window(),
        Some(MwOp {
            key: 0x300,
            variant: 0x05,
            qpn: 0x1a2,
            bind: Some(MwBind {
                start: 0x9000,
                len: 256,
                access: crate::wqe::MKEY_ACCESS_REMOTE_WRITE,
                mr_key: 0x201,
                mr_addr: 0x9000,
            }),
            check_free: true,
            check_qpn: false,
        })
    );
    let inv = umr_bytes(0x305, 0xffff_ff00, None, UMR_FLAG_CHECK_QPN);
    match parse_wqe(&inv).unwrap().op {
        ParsedOp::Umr(u) => {
            let w = u.window().unwrap();
            assert_eq!(
                (w.key, w.qpn, w.bind, w.check_qpn),
                (0x305, 0xff_ffff, None, true)
            )
        }
        other => panic!("{other:?}"),
    }
    // a WQE whose units stop before the KLMs it announces is malformed; a bind whose KLM
    // disagrees with the length is no window operation
    let mut short = b.clone();
    short[7] = 8;
    assert!(matches!(
        parse_wqe(&short[..128]),
        Err(WqeError::BadShape { .. })
    ));
    let mut odd = b.clone();
    odd[8 * DS_UNIT + 3] ^= 1;
    match parse_wqe(&odd).unwrap().op {
        ParsedOp::Umr(u) => assert_eq!(u.window(), None),
        other => panic!("{other:?}"),
    }
}

#[test]
fn send_with_invalidate_carries_the_rkey() {
    let mut w = Op::Send {
        local: Local::Sges(&[sge(0x1000, 8)]),
        imm: None,
    }
    .encode(3, 0x1a2, CtrlFlags::SIGNALED)
    .unwrap()
    .as_bytes()
    .to_vec();
    w[0..4].copy_from_slice(&(3u32 << 8 | Opcode::SendInval as u32).to_be_bytes());
    w[12..16].copy_from_slice(&0x4242u32.to_be_bytes());
    let p = parse_wqe(&w).unwrap();
    assert_eq!((p.invalidate(), p.imm()), (Some(0x4242), None));
    assert!(matches!(p.op, ParsedOp::Send { .. }));
}

#[test]
fn window_ops_encode_as_libmlx5_writes_them() {
    use crate::wqe::{WindowBind, MKEY_ACCESS_REMOTE_READ};
    let bind = WindowBind {
        window: 0x300,
        variant: 0x05,
        qpn: Some(0x1a2),
        region: sge(0x9000, 256),
        start: 0x9000,
        access: MKEY_ACCESS_REMOTE_READ,
    };
    let w = Op::BindWindow(bind)
        .encode(7, 0x1a2, CtrlFlags::SIGNALED)
        .unwrap();
    // the same bytes as the hand-made layout, but for the rights and the lkey
    let mine = umr_bytes(
        0x300,
        0x1a2 << 8 | 0x05,
        Some((0x9000, 256, 9)),
        UMR_FLAG_CHECK_FREE,
    );
    let p = parse_wqe(w.as_bytes()).unwrap();
    let q = parse_wqe(&mine).unwrap();
    match (p.op, q.op) {
        (ParsedOp::Umr(a), ParsedOp::Umr(b)) => {
            let (a, b) = (a.window().unwrap(), b.window().unwrap());
            assert_eq!(a.bind.unwrap().access, MKEY_ACCESS_REMOTE_READ);
            let same = MwOp {
                bind: a.bind.map(|x| MwBind {
                    access: crate::wqe::MKEY_ACCESS_REMOTE_WRITE,
                    ..x
                }),
                ..a
            };
            assert_eq!(same, b);
        }
        other => panic!("{other:?}"),
    }
    let inv = Op::LocalInvalidate { rkey: 0x305 }
        .encode(9, 0x1a2, CtrlFlags::SIGNALED)
        .unwrap();
    match parse_wqe(inv.as_bytes()).unwrap().op {
        ParsedOp::Umr(m) => assert_eq!(
            m.window()
                .map(|m| (m.key, m.bind, m.check_qpn, m.check_free)),
            Some((0x305, None, true, false))
        ),
        other => panic!("{other:?}"),
    }
    let unbind = Op::BindWindow(WindowBind {
        qpn: None,
        region: sge(0x9000, 0),
        ..bind
    })
    .encode(9, 0x1a2, CtrlFlags::SIGNALED)
    .unwrap();
    match parse_wqe(unbind.as_bytes()).unwrap().op {
        ParsedOp::Umr(m) => assert_eq!(
            m.window()
                .map(|m| (m.key, m.qpn, m.bind, m.check_qpn, m.check_free)),
            Some((0x300, 0xff_ffff, None, false, false))
        ),
        other => panic!("{other:?}"),
    }
    let s = Op::SendInvalidate {
        local: Local::Sges(&[sge(0x1000, 8)]),
        rkey: 0x4242,
    }
    .encode(1, 0x1a2, CtrlFlags::SIGNALED)
    .unwrap();
    assert_eq!(parse_wqe(s.as_bytes()).unwrap().invalidate(), Some(0x4242));
}

fn av(dest_qpn: u32, qkey: u32) -> crate::wqe::DatagramSeg {
    let mut rgid = [0u8; 16];
    rgid[10] = 0xff;
    rgid[11] = 0xff;
    rgid[12..].copy_from_slice(&[127, 0, 140, 2]);
    crate::wqe::DatagramSeg {
        qkey: crate::Be32::new(qkey),
        dqp_dct: crate::Be32::new(dest_qpn | crate::wqe::EXTENDED_UD_AV),
        rmac: [2, 0, 127, 0, 140, 2],
        tclass: 3,
        hop_limit: 64,
        grh_gid_fl: crate::Be32::new(0x0012_3456),
        rgid,
        ..Default::default()
    }
}

#[test]
fn ud_send_parses_with_its_datagram_segment() {
    let list = [sge(0x1000, 100), sge(0x2000, 28)];
    let w = Op::Send {
        local: Local::Sges(&list),
        imm: Some(0xdead_beef),
    }
    .encode(5, 0x42, CtrlFlags::SIGNALED)
    .unwrap()
    .with_datagram(&av(0x1234, 0x1111_2222))
    .unwrap();
    assert_eq!(w.ds(), 1 + 3 + 2);
    // the datagram segment's bytes are where libmlx5 puts mlx5_wqe_av
    let b = w.as_bytes();
    assert_eq!(&b[16..20], &0x1111_2222u32.to_be_bytes());
    assert_eq!(&b[24..28], &(0x8000_1234u32).to_be_bytes());
    assert_eq!(&b[36..42], &[2, 0, 127, 0, 140, 2]);
    assert_eq!(&b[60..64], &[127, 0, 140, 2]);
    let (p, d) = parse_ud_wqe(b).unwrap();
    let d = d.unwrap();
    assert_eq!(p.opcode, Opcode::SendImm);
    assert_eq!(p.imm(), Some(0xdead_beef));
    assert_eq!((p.wqe_index, p.qpn), (5, 0x42));
    assert_eq!(
        (d.qkey, d.dest_qpn, d.extended, d.tclass, d.hop_limit),
        (0x1111_2222, 0x1234, true, 3, 64)
    );
    assert_eq!((d.sgid_index, d.flow_label), (1, 0x2_3456));
    assert_eq!(&d.rgid[12..], &[127, 0, 140, 2]);
    match p.op {
        ParsedOp::Send {
            local: ParsedLocal::Sges(s),
        } => assert_eq!(s.len(), 2),
        other => panic!("{other:?}"),
    }
    // inline data after the datagram segment
    let w = Op::Send {
        local: Local::Inline(b"hello ud"),
        imm: None,
    }
    .encode(0, 0x42, CtrlFlags::SIGNALED)
    .unwrap()
    .with_datagram(&av(7, 0x8000_0000))
    .unwrap();
    let (p, d) = parse_ud_wqe(w.as_bytes()).unwrap();
    assert_eq!(d.unwrap().qkey, 0x8000_0000);
    assert_eq!(
        p.op,
        ParsedOp::Send {
            local: ParsedLocal::Inline(b"hello ud")
        }
    );
    // a NOP has no address vector
    let nop = Op::Nop.encode(1, 0x42, CtrlFlags::SIGNALED).unwrap();
    assert_eq!(parse_ud_wqe(nop.as_bytes()).unwrap().1, None);
}

#[test]
fn ud_refuses_rdma_atomics_and_short_shapes() {
    let list = [sge(0x1000, 8)];
    for op in [
        Op::Write {
            remote: R,
            local: Local::Sges(&list),
            imm: None,
        },
        Op::Read {
            remote: R,
            local: &list,
        },
        Op::FetchAdd {
            remote: R,
            add: 1,
            result: sge(0x1000, 8),
        },
    ] {
        let w = op.encode(0, 1, CtrlFlags::SIGNALED).unwrap();
        let e = parse_ud_wqe(w.as_bytes()).unwrap_err();
        assert!(matches!(e, WqeError::NotOnUd { .. }), "{e:?}");
        assert_eq!(e.syndrome(), Syndrome::LocalQpOp);
    }
    // a SEND without its datagram segment (ds 2: ctrl + one data segment) is malformed
    let w = Op::Send {
        local: Local::Sges(&list),
        imm: None,
    }
    .encode(0, 1, CtrlFlags::SIGNALED)
    .unwrap();
    assert!(matches!(
        parse_ud_wqe(w.as_bytes()),
        Err(WqeError::BadShape { .. })
    ));
    // truncated input, any bytes: errors, never a panic
    assert!(parse_ud_wqe(&[0u8; 8]).is_err());
    let mut x = 0x1234_5678u32;
    for _ in 0..20_000 {
        let mut b = [0u8; 128];
        for v in b.iter_mut() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *v = x as u8;
        }
        b[3] = [0x0a, 0x0b, 0x00, 0x08][(x % 4) as usize];
        let _ = parse_ud_wqe(&b[..(x as usize % 129)]);
    }
}

#[test]
fn dc_wqes_parse_with_their_address_vector() {
    let mut rgid = [0u8; 16];
    rgid[15] = 9;
    let key = 0x1122_3344_5566_7788;
    let dc = crate::wqe::DatagramSeg::dc(0x4321, key, rgid);
    let list = [sge(0x1000, 64)];
    let ops = [
        Op::Write {
            remote: R,
            local: Local::Sges(&list),
            imm: Some(7),
        },
        Op::Write {
            remote: R,
            local: Local::Inline(b"inline over dc"),
            imm: None,
        },
        Op::Read {
            remote: R,
            local: &list,
        },
        Op::Send {
            local: Local::Sges(&list),
            imm: None,
        },
        Op::FetchAdd {
            remote: R,
            add: 5,
            result: sge(0x2000, 8),
        },
        Op::CompareSwap {
            remote: R,
            compare: 1,
            swap: 2,
            result: sge(0x2000, 8),
        },
    ];
    for op in ops {
        let plain = op.encode(3, 0x77, CtrlFlags::SIGNALED).unwrap();
        let w = plain.with_datagram(&dc).unwrap();
        // the key's bytes are where libmlx5's mlx5dv_wr_set_dc_addr puts av.key.dc_key
        assert_eq!(&w.as_bytes()[16..24], &key.to_be_bytes());
        let (p, a) = parse_dc_wqe(w.as_bytes()).unwrap();
        let a = a.unwrap();
        assert_eq!((a.key, a.dctn, a.rgid), (key, 0x4321, rgid));
        // the operation reads as the same WQE without the vector does on RC
        let rc = parse_wqe(plain.as_bytes()).unwrap();
        assert_eq!(
            (p.op, p.opcode, p.imm, p.wqe_index),
            (rc.op, rc.opcode, rc.imm, 3)
        );
        assert_eq!(p.ds, rc.ds + 3);
    }
    // local WQEs carry no vector
    let nop = Op::Nop.encode(1, 0x77, CtrlFlags::SIGNALED).unwrap();
    assert_eq!(parse_dc_wqe(nop.as_bytes()).unwrap().1, None);
    // SEND with invalidate is refused; a WRITE without its vector is malformed
    let inv = Op::SendInvalidate {
        local: Local::Sges(&list),
        rkey: 1,
    }
    .encode(0, 0x77, CtrlFlags::SIGNALED)
    .unwrap()
    .with_datagram(&dc)
    .unwrap();
    let e = parse_dc_wqe(inv.as_bytes()).unwrap_err();
    assert!(matches!(e, WqeError::NotOnDci { .. }), "{e:?}");
    assert_eq!(e.syndrome(), Syndrome::LocalQpOp);
    let bare = Op::Read {
        remote: R,
        local: &list,
    }
    .encode(0, 0x77, CtrlFlags::SIGNALED)
    .unwrap();
    assert!(parse_dc_wqe(bare.as_bytes()).is_err());
    // an atomic whose ds ends at the address vector (found by the wqe fuzz target: the
    // operands were read past the WQE, out of the 64 bytes given): a shape error
    let mut w = [0u8; 64];
    w[0] = OPMOD_MASKED_ATOMIC_8B;
    w[3] = Opcode::AtomicMaskedFa as u8;
    w[7] = 4;
    w[16..64].copy_from_slice(bytemuck::bytes_of(&dc));
    assert!(matches!(parse_dc_wqe(&w), Err(WqeError::BadShape { .. })));
    for ds in 1..=6u8 {
        for op in [Opcode::AtomicFa, Opcode::AtomicCs, Opcode::AtomicMaskedCs] {
            let mut w = [0u8; 64];
            w[3] = op as u8;
            w[7] = ds;
            let _ = parse_dc_wqe(&w[..(ds as usize * 16).min(64)]);
            let _ = parse_wqe(&w[..(ds as usize * 16).min(64)]);
        }
    }
    // any bytes: errors, never a panic
    let mut x = 0x9e37_79b9u32;
    for _ in 0..20_000 {
        let mut b = [0u8; 192];
        for v in b.iter_mut() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *v = x as u8;
        }
        b[3] = [0x0a, 0x0b, 0x10, 0x11, 0x12, 0x08, 0x14, 0x13][(x % 8) as usize];
        b[7] = (x >> 8) as u8 % 12;
        let _ = parse_dc_wqe(&b[..(x as usize % 193)]);
    }
}

/// A data segment's 16 bytes.
fn dseg(bc: u32, lkey: u32, addr: u64) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[0..4].copy_from_slice(&bc.to_be_bytes());
    d[4..8].copy_from_slice(&lkey.to_be_bytes());
    d[8..16].copy_from_slice(&addr.to_be_bytes());
    d
}

#[test]
fn inline_and_pointer_segments_mix_in_wqe_order() {
    // SEND: ctrl, inline 8 bytes (1 unit), pointer, inline 20 bytes (2 units), pointer: ds 6
    let mut b = raw(0x0a, 0, 6);
    b[16..20].copy_from_slice(&(8 | INLINE_SEG).to_be_bytes());
    b[20..28].copy_from_slice(b"UCX-hdr!");
    b[32..48].copy_from_slice(&dseg(40, 9, 0x1000));
    b[48..52].copy_from_slice(&(20 | INLINE_SEG).to_be_bytes());
    b[52..72].copy_from_slice(&[0x5a; 20]);
    b[80..96].copy_from_slice(&dseg(0, 7, 0x2000));
    let p = parse_wqe(&b[..96]).unwrap();
    let ParsedOp::Send { local } = p.op else {
        panic!("{:?}", p.op)
    };
    assert!(matches!(local, ParsedLocal::Mixed(_)), "{local:?}");
    let segs: Vec<LocalSeg<'_>> = local.segments().collect();
    assert_eq!(
        segs,
        [
            LocalSeg::Inline(b"UCX-hdr!"),
            LocalSeg::Sge(sge(0x1000, 40)),
            LocalSeg::Inline(&[0x5a; 20]),
            LocalSeg::Sge(Sge {
                addr: 0x2000,
                len: ZERO_BYTE_COUNT_LEN,
                lkey: Lkey(7),
            }),
        ]
    );
    assert_eq!(local.inline_len(), 28);
    assert_eq!(local.len(), 8 + 40 + 20 + ZERO_BYTE_COUNT_LEN as u64);
    // the same in a WRITE (after the remote segment)
    let mut w = raw(0x08, 0, 4);
    w[32..36].copy_from_slice(&(8 | INLINE_SEG).to_be_bytes());
    w[48..64].copy_from_slice(&dseg(16, 9, 0x3000));
    let p = parse_wqe(&w).unwrap();
    let ParsedOp::Write { local, .. } = p.op else {
        panic!("{:?}", p.op)
    };
    assert_eq!(local.segments().count(), 2);
    assert_eq!(local.len(), 24);
    // a pointer then an inline segment
    let mut s = raw(0x0a, 0, 3);
    s[16..32].copy_from_slice(&dseg(4, 9, 0x1000));
    s[32..36].copy_from_slice(&(3 | INLINE_SEG).to_be_bytes());
    let ParsedOp::Send { local } = parse_wqe(&s).unwrap().op else {
        panic!()
    };
    assert_eq!(
        local.segments().collect::<Vec<_>>(),
        [LocalSeg::Sge(sge(0x1000, 4)), LocalSeg::Inline(&[0, 0, 0])]
    );
    // an inline segment after a pointer that runs past ds
    s[32..36].copy_from_slice(&(13 | INLINE_SEG).to_be_bytes());
    assert_eq!(
        parse_wqe(&s),
        Err(WqeError::InlineLength { len: 13, units: 1 })
    );
    // a READ's scatter list takes no inline segment, first or later
    let mut r = raw(0x10, 0, 4);
    r[32..48].copy_from_slice(&dseg(8, 9, 0x1000));
    r[48..52].copy_from_slice(&(4 | INLINE_SEG).to_be_bytes());
    assert_eq!(
        parse_wqe(&r),
        Err(WqeError::InlineNotAllowed { opcode: 0x10 })
    );
}
