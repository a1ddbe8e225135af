//! WRITE and SEND WQEs whose data segments mix inline and pointer segments (UCX posts an
//! inline header followed by pointer segments this way): a ConnectX gathers the segments in
//! WQE order. In process and over the wire; the inline part still counts against max_inline,
//! and a bad key in a later pointer segment is LOCAL_PROT.

mod common;
mod wire_util;

use common::*;
use prm::wqe::INLINE_SEG;
use prm::{Completion, Syndrome};
use softnic::outcome::vendor;
use softnic::{Access, WireFaults};
use wire_util::*;

/// A data segment of the WQE body.
enum Seg<'a> {
    Inline(&'a [u8]),
    Ptr(u64, u32, u32),
}

/// The raw WQE: control segment (signaled), an optional remote-address segment, `segs`.
fn wqe(opcode: u8, idx: u16, qpn: u32, remote: Option<(u64, u32)>, segs: &[Seg<'_>]) -> Vec<u8> {
    let mut body = Vec::new();
    if let Some((addr, rkey)) = remote {
        body.extend_from_slice(&addr.to_be_bytes());
        body.extend_from_slice(&rkey.to_be_bytes());
        body.extend_from_slice(&[0; 4]);
    }
    for s in segs {
        match s {
            Seg::Inline(b) => {
                body.extend_from_slice(&(b.len() as u32 | INLINE_SEG).to_be_bytes());
                body.extend_from_slice(b);
                body.resize(body.len().next_multiple_of(16), 0);
            }
            Seg::Ptr(addr, len, lkey) => {
                body.extend_from_slice(&len.to_be_bytes());
                body.extend_from_slice(&lkey.to_be_bytes());
                body.extend_from_slice(&addr.to_be_bytes());
            }
        }
    }
    let ds = 1 + body.len() / 16;
    let mut w = Vec::with_capacity(64 * ds.div_ceil(4));
    w.extend_from_slice(&((idx as u32) << 8 | opcode as u32).to_be_bytes());
    w.extend_from_slice(&(qpn << 8 | ds as u32).to_be_bytes());
    w.extend_from_slice(&[0, 0, 0, 0x08, 0, 0, 0, 0]);
    w.extend_from_slice(&body);
    w.resize(64 * ds.div_ceil(4), 0);
    w
}

fn run(p: &mut Pair) {
    let src = p.a.buf(4096, Access::NONE);
    let dst = p.b.buf(8192, Access::REMOTE_WRITE | Access::LOCAL_WRITE);
    fill_random(&src, 7);
    let s = src.bytes();
    let lkey = src.lkey().0;
    let hdr = *b"UCX-hdr!";
    let tail = [0x5au8; 20];

    // WRITE: inline header, 3000 bytes by pointer, 20 inline bytes, 100 bytes by pointer
    let idx = p.ea.ini.producer();
    let w = wqe(
        0x08,
        idx,
        p.ea.qpn(),
        Some((dst.addr(0), dst.rkey().0)),
        &[
            Seg::Inline(&hdr),
            Seg::Ptr(src.addr(0), 3000, lkey),
            Seg::Inline(&tail),
            Seg::Ptr(src.addr(100), 100, lkey),
        ],
    );
    assert_eq!(p.ea.post_raw(&w), idx);
    p.ea.ini.ring();
    p.ea.expect_req(0x08, idx);
    let mut want = hdr.to_vec();
    want.extend_from_slice(&s[..3000]);
    want.extend_from_slice(&tail);
    want.extend_from_slice(&s[100..200]);
    assert_eq!(dst.read(0, want.len()), want, "WRITE gathered out of order");
    assert_eq!(dst.read(want.len(), 16), [0u8; 16]);

    // SEND: inline header then a pointer segment
    dst.fill(0);
    let rq = p.eb.ini.post_recv(&[dst.sge(0, 8192)]).unwrap();
    let idx = p.ea.ini.producer();
    let w = wqe(
        0x0a,
        idx,
        p.ea.qpn(),
        None,
        &[Seg::Inline(&hdr), Seg::Ptr(src.addr(50), 1500, lkey)],
    );
    p.ea.post_raw(&w);
    p.ea.ini.ring();
    p.ea.expect_req(0x0a, idx);
    match p.eb.recv_cqe() {
        Completion::Resp {
            byte_cnt,
            wqe_counter,
            ..
        } => assert_eq!((byte_cnt, wqe_counter), (1508, rq)),
        c => panic!("{c:?}"),
    }
    let mut want = hdr.to_vec();
    want.extend_from_slice(&s[50..1550]);
    assert_eq!(dst.read(0, want.len()), want, "SEND gathered out of order");

    // a bad key in the pointer segment after the inline one: LOCAL_PROT
    let idx = p.ea.ini.producer();
    let w = wqe(
        0x0a,
        idx,
        p.ea.qpn(),
        None,
        &[Seg::Inline(&hdr), Seg::Ptr(src.addr(0), 64, lkey ^ 0x100)],
    );
    p.ea.post_raw(&w);
    p.ea.ini.ring();
    p.ea.expect_err(Syndrome::LocalProt, vendor::LOCAL_KEY, 0x0a, idx);
}

#[test]
fn mixed_inline_and_pointer_segments_in_process() {
    let mut p = local_pair(Opts::default(), Opts::default());
    run(&mut p);
}

#[test]
fn mixed_inline_and_pointer_segments_over_the_wire() {
    let _serial = serial();
    let mut p = wire_pair(
        wire_opts(),
        wire_opts(),
        1024,
        WireFaults::default(),
        WireFaults::default(),
    );
    run(&mut p);
}

#[test]
fn the_inline_part_of_a_mixed_wqe_counts_against_max_inline() {
    let o = Opts {
        max_inline: 16,
        ..Opts::default()
    };
    let mut p = local_pair(o, Opts::default());
    let src = p.a.buf(64, Access::NONE);
    p.eb.ini
        .post_recv(&[p.b.buf(256, Access::LOCAL_WRITE).sge(0, 256)])
        .unwrap();
    let idx = p.ea.ini.producer();
    let w = wqe(
        0x0a,
        idx,
        p.ea.qpn(),
        None,
        &[
            Seg::Inline(&[1; 12]),
            Seg::Ptr(src.addr(0), 8, src.lkey().0),
            Seg::Inline(&[2; 12]),
        ],
    );
    p.ea.post_raw(&w);
    p.ea.ini.ring();
    p.ea.expect_err(Syndrome::LocalLength, vendor::TOO_LONG, 0x0a, idx);
}
