//! Indirect mkeys: created free (as DEVX CREATE_MKEY makes them), given a KLM list or a
//! repeated block of strided entries by UMR WQEs as libmlx5 writes them
//! (`mlx5dv_wr_mr_list`, `mlx5dv_wr_mr_interleaved`, `mlx5dv_wr_mkey_configure`), used as
//! lkeys of gather and scatter lists and as rkeys, freed by LOCAL_INV and by a peer's
//! SEND_WITH_INV; and every refusal: a free mkey, a range past its length, a layout that does
//! not add up, more entries than it was created for, an entry naming another indirect mkey.
//! The same checks run on the in-process path and over the wire.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{
    DataSeg, Local, Op, Opcode, MKEY_ACCESS_LOCAL_WRITE, MKEY_ACCESS_REMOTE_WRITE,
    UMR_FLAG_CHECK_QPN, UMR_FLAG_INLINE, UMR_MASK_ACCESS, UMR_MASK_FREE, UMR_MASK_LEN,
    UMR_MASK_MKEY,
};
use prm::{Completion, RemoteAddr, Rkey, Sge, Syndrome};

use softnic::outcome::vendor;
use softnic::*;
use wire_util::*;

const UMR: u8 = Opcode::Umr as u8;

/// A free indirect mkey of `entries` entries in `n`'s PD.
fn indirect(n: &Node, entries: u32, remote_invalidate: bool) -> u32 {
    n.dev.create_indirect(IndirectConfig {
        pd: n.pd,
        variant: 0,
        qpn: 0xff_ffff,
        max_entries: entries,
        remote_invalidate,
        access: Access::NONE,
        start: 0,
    })
}

/// A KLM list translation: each entry as a data segment, padded to 64 bytes.
fn list(entries: &[Sge]) -> Vec<u8> {
    let mut x: Vec<u8> = entries
        .iter()
        .flat_map(|s| bytemuck::bytes_of(&DataSeg::new(*s)).to_vec())
        .collect();
    x.resize(x.len().div_ceil(64) * 64, 0);
    x
}

/// A repeated-block translation: `count` blocks of `(sge, skip)` entries, padded to 64 bytes.
fn repeat(count: u32, entries: &[(Sge, u16)]) -> Vec<u8> {
    let block: u32 = entries.iter().map(|(s, _)| s.len).sum();
    let mut x = Vec::new();
    x.extend_from_slice(&block.to_be_bytes());
    x.extend_from_slice(&0x400u32.to_be_bytes());
    x.extend_from_slice(&count.to_be_bytes());
    x.extend_from_slice(&0u16.to_be_bytes());
    x.extend_from_slice(&(entries.len() as u16).to_be_bytes());
    for (s, skip) in entries {
        x.extend_from_slice(&(s.len as u16 + skip).to_be_bytes());
        x.extend_from_slice(&(s.len as u16).to_be_bytes());
        x.extend_from_slice(&s.lkey.0.to_be_bytes());
        x.extend_from_slice(&s.addr.to_be_bytes());
    }
    x.resize(x.len().div_ceil(64) * 64, 0);
    x
}

/// A UMR WQE as `mlx5dv_wr_mkey_configure` + access flags + layout writes it (or, with
/// `xlat` `None`, the LOCAL_INV libmlx5 writes), for index `idx` of QP `qpn`.
fn umr(idx: u16, qpn: u32, key: u32, access: u8, len: u64, xlat: Option<&[u8]>) -> Vec<u8> {
    let x = xlat.unwrap_or(&[]);
    let units = 1 + 3 + 4 + x.len() / 16;
    let mut w = vec![0u8; units.div_ceil(4) * 64];
    w[0..4].copy_from_slice(&((idx as u32) << 8 | UMR as u32).to_be_bytes());
    w[4..8].copy_from_slice(&(qpn << 8 | units as u32).to_be_bytes());
    w[11] = 0x08; // signaled
    w[12..16].copy_from_slice(&key.to_be_bytes());
    let (flags, mask) = match xlat {
        Some(_) => (
            UMR_FLAG_INLINE,
            UMR_MASK_FREE | UMR_MASK_MKEY | UMR_MASK_ACCESS | UMR_MASK_LEN,
        ),
        None => (
            UMR_FLAG_INLINE | UMR_FLAG_CHECK_QPN,
            UMR_MASK_FREE | UMR_MASK_MKEY,
        ),
    };
    let u = &mut w[16..64];
    u[0] = flags;
    u[4..6].copy_from_slice(&((x.len() / 16) as u16).to_be_bytes());
    u[8..16].copy_from_slice(&mask.to_be_bytes());
    let m = &mut w[64..128];
    m[0] = if xlat.is_some() { 0 } else { 1 << 6 };
    m[2] = access;
    m[4..8].copy_from_slice(&(0xffff_ff00 | (key & 0xff)).to_be_bytes());
    m[24..32].copy_from_slice(&len.to_be_bytes());
    w[128..128 + x.len()].copy_from_slice(x);
    w
}

/// Posts and rings a UMR on `ep`; returns its index.
fn post_umr(ep: &mut Ep, key: u32, access: u8, len: u64, xlat: Option<&[u8]>) -> u16 {
    let w = umr(ep.ini.producer(), ep.qpn(), key, access, len, xlat);
    let idx = ep.post_raw(&w);
    ep.ini.ring();
    idx
}

/// `len` bytes at `addr` through key `k`.
fn lkey(k: u32, addr: u64, len: u32) -> Sge {
    Sge {
        addr,
        len,
        lkey: prm::Lkey(k),
    }
}

fn send(data: &[Sge]) -> Op<'_> {
    Op::Send {
        local: Local::Sges(data),
        imm: None,
    }
}

fn pair(wire: bool) -> Pair {
    if wire {
        wire_pair(
            wire_opts(),
            wire_opts(),
            1024,
            WireFaults::default(),
            WireFaults::default(),
        )
    } else {
        Pair::new()
    }
}

/// A SEND gathered through a list mkey on one side lands through an interleaved mkey on the
/// other, 3000 bytes so that over the wire it takes several packets; a remote WRITE through
/// a list mkey lands in its entry.
fn round_trip(p: &mut Pair) {
    // sender: an mkey over two pieces of `src`, 1000 and 2000 bytes, out of order
    let src = p.a.buf(8192, Access::LOCAL_WRITE);
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();
    src.write(4000, &data[..1000]);
    src.write(100, &data[1000..]);
    let ka = indirect(&p.a, 4, false);
    let x = list(&[src.sge(4000, 1000), src.sge(100, 2000)]);
    let idx = post_umr(&mut p.ea, ka, 0, 3000, Some(&x));
    assert_eq!(p.ea.expect_req(UMR, idx), 0);
    // receiver: 3 blocks of (100 bytes, skip 20) + (900 bytes, skip 0) over `dst`
    let dst = p.b.buf(8192, Access::LOCAL_WRITE);
    let kb = indirect(&p.b, 4, false);
    let x = repeat(3, &[(dst.sge(0, 100), 20), (dst.sge(4000, 900), 0)]);
    let idx = post_umr(&mut p.eb, kb, MKEY_ACCESS_LOCAL_WRITE, 3000, Some(&x));
    assert_eq!(p.eb.expect_req(UMR, idx), 0);
    let ridx =
        p.eb.ini
            .post_recv(&[Sge {
                addr: 0,
                len: 3000,
                lkey: prm::Lkey(kb),
            }])
            .unwrap();
    let whole = [Sge {
        addr: 0,
        len: 3000,
        lkey: prm::Lkey(ka),
    }];
    let idx = p.ea.go(&send(&whole), SIG);
    assert_eq!(p.ea.expect_req(Opcode::Send as u8, idx), 3000);
    match p.eb.recv_cqe() {
        Completion::Resp { byte_cnt, .. } => assert_eq!(byte_cnt, 3000),
        c => panic!("{c:?} (receive {ridx})"),
    }
    // block r: 100 bytes at 120 r, then 900 bytes at 4000 + 900 r
    for r in 0..3 {
        let b = &data[r * 1000..(r + 1) * 1000];
        assert_eq!(dst.read(120 * r, 100), &b[..100], "block {r}, entry 0");
        assert_eq!(
            dst.read(4000 + 900 * r, 900),
            &b[100..],
            "block {r}, entry 1"
        );
        if r < 2 {
            assert_eq!(dst.read(120 * r + 100, 20), [0u8; 20], "skipped bytes");
        }
    }
    assert!(dst.guards_intact());
    // a remote WRITE through an mkey with remote write, inside one of its entries
    let target =
        p.b.buf(4096, Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0));
    let kw = indirect(&p.b, 4, false);
    let x = list(&[target.sge(2048, 1024), target.sge(0, 1024)]);
    let idx = post_umr(
        &mut p.eb,
        kw,
        MKEY_ACCESS_LOCAL_WRITE | MKEY_ACCESS_REMOTE_WRITE,
        2048,
        Some(&x),
    );
    assert_eq!(p.eb.expect_req(UMR, idx), 0);
    let w = Op::Write {
        remote: RemoteAddr {
            addr: 1024 + 10,
            rkey: Rkey(kw),
        },
        local: Local::Inline(b"through the second entry"),
        imm: None,
    };
    let idx = p.ea.go(&w, SIG);
    p.ea.expect_req(Opcode::RdmaWrite as u8, idx);
    assert_eq!(target.read(10, 24), b"through the second entry");
    // LOCAL_INV frees the sender's mkey: a gather through it is a local protection error
    let idx = post_umr(&mut p.ea, ka, 0, 0, None);
    assert_eq!(p.ea.expect_req(UMR, idx), 0);
    let idx = p.ea.go(&send(&whole), SIG);
    p.ea.expect_err(
        Syndrome::LocalProt,
        vendor::LOCAL_KEY,
        Opcode::Send as u8,
        idx,
    );
}

#[test]
fn indirect_mkeys_in_process() {
    round_trip(&mut Pair::new());
}

#[test]
fn indirect_mkeys_over_the_wire() {
    let _serial = serial();
    let mut p = pair(true);
    round_trip(&mut p);
    let (ca, cb) = (p.a.dev.counters(), p.b.dev.counters());
    assert!(ca.wire.tx_packets > 0 && cb.wire.rx_packets > 0);
    assert_eq!(ca.wire.rx_malformed + cb.wire.rx_malformed, 0);
}

/// UMRs a ConnectX refuses complete with MW_BIND_ERR.
#[test]
fn bad_layouts_are_refused() {
    type Layout = fn(&Buf, u32) -> (u64, Vec<u8>);
    let cases: [(&str, Layout); 4] = [
        ("entries short of the length", |b, _| {
            (64, list(&[b.sge(0, 32)]))
        }),
        ("more entries than created for", |b, _| {
            let five: Vec<Sge> = (0..5).map(|i| b.sge(i * 16, 16)).collect();
            (80, list(&five))
        }),
        ("an entry naming an indirect mkey", |_, other| {
            (32, list(&[lkey(other, 0, 32)]))
        }),
        ("repeated blocks short of the length", |b, _| {
            (100, repeat(2, &[(b.sge(0, 16), 0)]))
        }),
    ];
    for (what, layout) in cases {
        let mut p = Pair::new();
        let buf = p.a.buf(4096, Access::LOCAL_WRITE);
        let k = indirect(&p.a, 4, false);
        let other = indirect(&p.a, 4, false);
        let (len, x) = layout(&buf, other);
        let idx = post_umr(&mut p.ea, k, 0, len, Some(&x));
        match p.ea.send_cqe() {
            Completion::Error(e) => assert_eq!(
                (e.syndrome, e.vendor_syndrome, e.wqe_counter),
                (Syndrome::MwBind as u8, vendor::UMR, idx),
                "{what}"
            ),
            c => panic!("{what}: {c:?}"),
        }
    }
}

/// Accesses the mkey refuses: while free, past its length, a right it was not given; a
/// remote access spanning two entries (one contiguous range is needed there); a UMR on an
/// mkey of another PD.
#[test]
fn accesses_are_checked() {
    // (what, configure first, the access through (requester's mkey, responder's mkey))
    type Try = fn(&mut Pair, u32, u32) -> (u16, Syndrome);
    let cases: [(&str, bool, Try); 4] = [
        ("free", false, |p, ka, _| {
            let s = [lkey(ka, 0, 8)];
            (p.ea.go(&send(&s), SIG), Syndrome::LocalProt)
        }),
        ("past the length", true, |p, ka, _| {
            let s = [lkey(ka, 8, 100)];
            (p.ea.go(&send(&s), SIG), Syndrome::LocalProt)
        }),
        (
            "a READ into an mkey without local write",
            true,
            |p, ka, _| {
                // the scatter list is checked before the request leaves
                let dst = [lkey(ka, 0, 8)];
                let r = Op::Read {
                    remote: RemoteAddr {
                        addr: 0,
                        rkey: Rkey(0),
                    },
                    local: &dst,
                };
                (p.ea.go(&r, SIG), Syndrome::LocalProt)
            },
        ),
        ("a remote WRITE spanning two entries", true, |p, _, kb| {
            let w = Op::Write {
                remote: RemoteAddr {
                    addr: 12,
                    rkey: Rkey(kb),
                },
                local: Local::Inline(b"12345678"),
                imm: None,
            };
            (p.ea.go(&w, SIG), Syndrome::RemoteAccess)
        }),
    ];
    for (what, configure, try_it) in cases {
        let mut p = Pair::new();
        let ba = p.a.buf(64, Access::LOCAL_WRITE);
        let bb =
            p.b.buf(64, Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0));
        let (ka, kb) = (indirect(&p.a, 4, false), indirect(&p.b, 4, false));
        if configure {
            let x = list(&[ba.sge(0, 16), ba.sge(32, 16)]);
            let idx = post_umr(&mut p.ea, ka, 0, 32, Some(&x));
            assert_eq!(p.ea.expect_req(UMR, idx), 0);
            let x = list(&[bb.sge(0, 16), bb.sge(32, 16)]);
            let rw = MKEY_ACCESS_LOCAL_WRITE | MKEY_ACCESS_REMOTE_WRITE;
            let idx = post_umr(&mut p.eb, kb, rw, 32, Some(&x));
            assert_eq!(p.eb.expect_req(UMR, idx), 0);
        }
        let (idx, syndrome) = try_it(&mut p, ka, kb);
        match p.ea.send_cqe() {
            Completion::Error(e) => {
                assert_eq!((e.syndrome, e.wqe_counter), (syndrome as u8, idx), "{what}")
            }
            c => panic!("{what}: {c:?}"),
        }
        assert_eq!(bb.read(0, 64), [0u8; 64], "{what}: nothing written");
    }
    // a UMR on an mkey of another PD
    let mut p = Pair::new();
    let pd2 = p.a.dev.alloc_pd();
    let k = p.a.dev.create_indirect(IndirectConfig {
        pd: pd2,
        variant: 0,
        qpn: 0xff_ffff,
        max_entries: 4,
        remote_invalidate: false,
        access: Access::NONE,
        start: 0,
    });
    let idx = post_umr(&mut p.ea, k, 0, 0, None);
    match p.ea.send_cqe() {
        Completion::Error(e) => assert_eq!(
            (e.syndrome, e.vendor_syndrome, e.wqe_counter),
            (Syndrome::MwBind as u8, vendor::UMR, idx)
        ),
        c => panic!("{c:?}"),
    }
}

/// SEND_WITH_INV of an indirect mkey frees it when it was created for remote invalidation;
/// otherwise the receive completes with LOCAL_PROT and the requester with REMOTE_INVAL_REQ.
#[test]
fn remote_invalidation() {
    for wire in [false, true] {
        let _serial = serial();
        for allowed in [true, false] {
            let mut p = pair(wire);
            let region = p.b.buf(64, Access::LOCAL_WRITE);
            let k = indirect(&p.b, 4, allowed);
            let x = list(&[region.sge(0, 32)]);
            let idx = post_umr(&mut p.eb, k, MKEY_ACCESS_LOCAL_WRITE, 32, Some(&x));
            assert_eq!(p.eb.expect_req(UMR, idx), 0);
            let into = |len| {
                [Sge {
                    addr: 0,
                    len,
                    lkey: prm::Lkey(k),
                }]
            };
            let ridx = p.eb.ini.post_recv(&into(0)).unwrap();
            let op = Op::SendInvalidate {
                local: Local::Sges(&[]),
                rkey: k,
            };
            let idx = p.ea.go(&op, SIG);
            if allowed {
                p.ea.expect_req(Opcode::SendInval as u8, idx);
                match p.eb.recv_cqe() {
                    Completion::Resp { .. } => {}
                    c => panic!("{c:?}"),
                }
                // the mkey is free now: a receive scattering into it fails
                let ridx = p.eb.ini.post_recv(&into(8)).unwrap();
                let op = Op::Send {
                    local: Local::Inline(b"12345678"),
                    imm: None,
                };
                let idx = p.ea.go(&op, SIG);
                match p.ea.send_cqe() {
                    Completion::Error(e) => {
                        assert_eq!((e.syndrome, e.wqe_counter), (Syndrome::RemoteOp as u8, idx))
                    }
                    c => panic!("{c:?}"),
                }
                p.eb.expect_recv_err(Syndrome::LocalProt, vendor::RECV_BUFFER, ridx);
            } else {
                match p.ea.send_cqe() {
                    Completion::Error(e) => assert_eq!(
                        (e.syndrome, e.wqe_counter),
                        (Syndrome::RemoteInvalReq as u8, idx)
                    ),
                    c => panic!("{c:?}"),
                }
                p.eb.expect_recv_err(Syndrome::LocalProt, vendor::UMR, ridx);
            }
        }
    }
}
