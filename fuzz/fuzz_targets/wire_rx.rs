//! The RoCEv2 receive path: datagrams from the connected peer's address (any source port)
//! into a soft NIC whose RC QP is in RTS (selective repeat or go-back-N), or into its peer (the
//! requester side, which takes answers). The oracle: every datagram is taken (counted) and
//! no more are counted as dropped than arrived; the device never panics or hangs; nothing is
//! written outside the registered buffers (guard bytes; AddressSanitizer for the rest); and
//! nothing executes out of window: the responder changes no memory and completes no receive
//! unless some datagram carried the PSN it expects (a request ahead of it may be held, never
//! run, until that PSN arrives), and the requester, which has nothing outstanding, takes no
//! response into memory.
//!
//! Input: a control byte, then datagrams, each behind a 2-byte big-endian length (at most 8).
//! Control bits: 0 selective repeat; 1 leave the ICRC as given (else the harness seals each
//! datagram for its flow, so that the fuzzer gets past the ICRC check); 2 leave the BTH's
//! destination QP as given (else it is the target's QPN); 3 send to the requester (A) instead
//! of the responder (B); 4 send to a DC target on B (key [`DC_KEY`], every remote right, over
//! B's buffers) instead: then no buffer of B changes unless some datagram presented the key;
//! 5 (without 4) send to an XRC target on B instead (connected to A, every remote right, its
//! domain holding an XRC SRQ with a receive over buffer 3): the XRC class and its XRCETH
//! parsed, the SRQ looked up in the domain; as for the RC responder, nothing runs unless some
//! datagram carried the PSN it expects. The fixture is fresh for each input: QPNs, keys, PSNs and addresses are the same in every
//! run, so seeds captured from a fresh pair stay meaningful.
#![no_main]

#[path = "../../crates/softnic/tests/common/mod.rs"]
mod common;
mod fixture;
#[path = "../../crates/softnic/tests/wire_util/mod.rs"]
mod wire_util;

use fixture::Fixture;
use libfuzzer_sys::fuzz_target;
use softnic::wire::packet::{self, Flow, BTH_LEN, ICRC_LEN};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BOUND: Duration = Duration::from_secs(5);
/// The DC target's access key (bit 4).
const DC_KEY: u64 = 0x1ee7_a330;
const MAX_DATAGRAMS: usize = 8;

/// An XRC target on B, in RTS, connected to A (B's RC QP's peer: the same address and PSNs),
/// with every remote right; its domain holds an XRC SRQ (B's receive CQ) with one receive over
/// buffer 3 (`key3`).
fn xrc_target(p: &common::Pair, key3: u32) -> (Arc<softnic::Qp>, common::SwSrq) {
    use softnic::{Modify, RtrAttr, SrqConfig, XrcSrqConfig};
    let xrcd = p.b.dev.alloc_xrcd();
    let srq =
        p.b.dev
            .create_xrc_srq(
                SrqConfig::new(p.b.pd, 16, 2),
                XrcSrqConfig {
                    xrcd: xrcd.clone(),
                    cq: p.eb.rcq.clone(),
                    user_index: None,
                },
            )
            .expect("an XRC SRQ");
    let mut sw = common::SwSrq::new(srq);
    sw.post(fixture::addr(3), fixture::LEN as u32, key3);
    let t = p.b.dev.create_xrc_tgt(&xrcd).expect("an XRC target");
    let o = wire_util::wire_opts();
    t.modify(Modify::Init {
        access: wire_util::ALL_REMOTE,
    })
    .expect("XRC target INIT");
    t.modify(Modify::Rtr(RtrAttr {
        remote_gid: p.a.dev.gid(),
        remote_qpn: p.ea.qpn(),
        rq_psn: o.rts.sq_psn,
        mtu: 1024,
        min_rnr_timer: 1,
        selective_repeat: false,
    }))
    .expect("XRC target RTR");
    t.modify(Modify::Rts(o.rts)).expect("XRC target RTS");
    (t, sw)
}

fn datagrams(mut d: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while d.len() >= 2 && out.len() < MAX_DATAGRAMS {
        let n = (u16::from_be_bytes([d[0], d[1]]) as usize).min(d.len() - 2);
        out.push(d[2..2 + n].to_vec());
        d = &d[2 + n..];
    }
    out
}

fuzz_target!(|d: &[u8]| {
    let Some((&ctl, rest)) = d.split_first() else {
        return;
    };
    let grams = datagrams(rest);
    if grams.is_empty() {
        return;
    }
    let mut f = Fixture::wire(ctl & 1 != 0);
    let p = &f.p;
    let dct = (ctl & 16 != 0).then(|| fixture::dc_target(&p.b, p.eb.rcq.clone(), DC_KEY));
    let xrc = (ctl & 48 == 32).then(|| xrc_target(p, f.mrs[3].key));
    let (target, qpn) = match (&dct, &xrc) {
        (Some(t), _) | (None, Some((t, _))) => (&p.b, t.qpn()),
        (None, None) if ctl & 8 != 0 => (&p.a, p.ea.qpn()),
        (None, None) => (&p.b, p.eb.qpn()),
    };
    let to = target.dev.wire_addr().expect("a wire port");
    let sock = UdpSocket::bind("127.0.0.1:0").expect("a UDP socket");
    let SocketAddr::V4(to4) = to else {
        panic!("IPv4 port");
    };
    let flow = Flow {
        src: Ipv4Addr::LOCALHOST,
        dst: *to4.ip(),
        sport: sock.local_addr().unwrap().port(),
        dport: to4.port(),
    };
    let before = target.dev.counters().wire.rx_packets;
    let mut sent = Vec::new();
    for mut g in grams.iter().cloned() {
        if g.len() >= BTH_LEN + ICRC_LEN {
            if ctl & 4 == 0 {
                g[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
            }
            if ctl & 2 == 0 {
                g.truncate(g.len() - ICRC_LEN);
                packet::seal(&flow, &mut g);
            }
        }
        sock.send_to(&g, to).expect("loopback send");
        sent.push(g);
    }
    let want = before + grams.len() as u64;
    let start = Instant::now();
    loop {
        let got = target.dev.counters().wire.rx_packets;
        if got >= want {
            break;
        }
        assert!(
            start.elapsed() < BOUND,
            "only {got} of {want} datagrams taken"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
    let c = target.dev.counters().wire;
    let dropped = c.rx_malformed
        + c.rx_bad_icrc
        + c.rx_not_plain_ip
        + c.rx_unknown_qp
        + c.rx_wrong_source
        + c.rx_unexpected
        + c.rx_bad_duplicate_reads;
    assert!(
        dropped <= c.rx_packets,
        "{dropped} datagrams counted as dropped of {} received: {c:?}",
        c.rx_packets
    );
    if let Some(t) = dct {
        // a DC target runs nothing for a request without its key
        let keyed = sent
            .iter()
            .any(|g| g.len() >= BTH_LEN + 8 && g[BTH_LEN..BTH_LEN + 8] == DC_KEY.to_be_bytes());
        if !keyed {
            std::thread::sleep(Duration::from_millis(2));
            assert!(
                fixture::untouched(1) && fixture::untouched(3),
                "a DC request ran without the target's key"
            );
        }
        p.b.dev.destroy_qp(&t);
    } else if let Some((t, _srq)) = xrc {
        // as the RC responder: nothing runs without the PSN the target expects
        let epsn = wire_util::wire_opts().rts.sq_psn & 0xff_ffff;
        let expected_seen = sent
            .iter()
            .any(|g| g.len() >= BTH_LEN && u32::from_be_bytes([0, g[9], g[10], g[11]]) == epsn);
        if !expected_seen {
            std::thread::sleep(Duration::from_millis(2));
            assert!(
                fixture::untouched(1) && fixture::untouched(3),
                "an XRC request ran without the expected PSN {epsn:#x} arriving"
            );
        }
        p.b.dev.destroy_qp(&t);
    } else if ctl & 8 != 0 {
        // the requester posted nothing: no answer may land in its memory
        assert!(
            fixture::untouched(0) && fixture::untouched(2),
            "a response without a request was taken into memory"
        );
    } else {
        // the responder runs a request only in PSN order from the one it expects
        let epsn = wire_util::wire_opts().rts.sq_psn & 0xff_ffff;
        let expected_seen = sent
            .iter()
            .any(|g| g.len() >= BTH_LEN && u32::from_be_bytes([0, g[9], g[10], g[11]]) == epsn);
        if !expected_seen {
            std::thread::sleep(Duration::from_millis(2));
            let recv = f.p.eb.ini.poll_recv();
            assert!(
                fixture::untouched(1) && fixture::untouched(3) && recv.is_none(),
                "a request ran without the expected PSN {epsn:#x} arriving ({recv:?})"
            );
        }
    }
    f.finish();
});
