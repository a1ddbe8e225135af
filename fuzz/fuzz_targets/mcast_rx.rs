//! The multicast receive path (`softnic::mcast`): datagrams that arrive at a device's socket
//! for an IPv4 group, on any bytes. The fixture: a soft device whose two UD QPs are attached
//! to group 239.47.0.1 (one with its self-loopback blocked), each with receives posted, and a
//! third QP not attached. The oracle: never a panic; every datagram is counted as received;
//! no more datagrams are taken into receives than arrived times the attached QPs; and the QP
//! that is not attached takes nothing.
//!
//! Input: a control byte, then datagrams, each behind a 2-byte big-endian length (at most 8).
//! Control bits: 0 leave the ICRC as given (else the harness seals each datagram for its
//! flow, so that the fuzzer gets past the ICRC check); 1 leave the BTH's destination QP as
//! given (else 0xFFFFFF, the multicast QPN); 2 the datagram comes from the device's own
//! address (else another host's).
#![no_main]

use libfuzzer_sys::fuzz_target;
use softnic::mcast::{self, McastAttach, MCAST_QPN};
use softnic::wire::packet::{self, Flow, BTH_LEN, ICRC_LEN};
use softnic::*;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

const QKEY: u32 = 0x0123_4567;
const MAX_DATAGRAMS: usize = 8;

fn datagrams(mut d: &[u8]) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    while d.len() >= 2 && v.len() < MAX_DATAGRAMS {
        let n = u16::from_be_bytes([d[0], d[1]]) as usize;
        d = &d[2..];
        let n = n.min(d.len());
        v.push(d[..n].to_vec());
        d = &d[n..];
    }
    v
}

struct Rx {
    qp: Arc<Qp>,
    ini: initiator::Initiator,
    _buf: Vec<u8>,
}

fn ud(dev: &Device, pd: PdId) -> Rx {
    let cq = || {
        dev.create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .unwrap()
    };
    let mut cfg = QpConfig::new(pd, cq(), cq());
    cfg.rq_wqes = 16;
    let qp = dev.create_ud_qp(cfg, None).unwrap();
    qp.modify(Modify::InitUd { qkey: QKEY }).unwrap();
    qp.modify(Modify::RtrUd).unwrap();
    qp.modify(Modify::Rts(RtsAttr::default())).unwrap();
    let mut buf = vec![0u8; 16 * 4096];
    // SAFETY: `buf` lives in `Rx`, dropped before the device.
    let mr = unsafe {
        dev.reg_host(pd, buf.as_mut_ptr() as u64, buf.len() as u64, Access::LOCAL_WRITE)
            .unwrap()
    };
    let mut ini = initiator::Initiator::for_soft_qp(dev, &qp, initiator::RingMode::RdmaCore);
    for i in 0..16u64 {
        let s = prm::wqe::Sge {
            addr: buf.as_ptr() as u64 + i * 4096,
            len: 4096,
            lkey: prm::Lkey(mr.key),
        };
        ini.post_recv(&[s]).unwrap();
    }
    Rx {
        qp,
        ini,
        _buf: buf,
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&ctl, rest)) = input.split_first() else {
        return;
    };
    let dev = Device::open(DeviceConfig::default()).unwrap();
    let group = Ipv4Addr::new(239, 47, 0, 1);
    let mgid = Gid::from_ipv4(group);
    let pd = dev.alloc_pd();
    let (a, b, c) = (ud(&dev, pd), ud(&dev, pd), ud(&dev, pd));
    dev.attach_mcast(&a.qp, mgid, McastAttach::default()).unwrap();
    let block = McastAttach {
        block_self_loopback: true,
    };
    dev.attach_mcast(&b.qp, mgid, block).unwrap();
    let src = if ctl & 4 != 0 {
        dev.gid().to_ipv4().unwrap_or(Ipv4Addr::LOCALHOST)
    } else {
        Ipv4Addr::new(127, 0, 47, 9)
    };
    let flow = Flow {
        src,
        dst: group,
        sport: 49152,
        dport: packet::ROCE_PORT,
    };
    let list = datagrams(rest);
    for mut d in list.iter().cloned() {
        if ctl & 2 == 0 && d.len() >= BTH_LEN {
            d[5..8].copy_from_slice(&MCAST_QPN.to_be_bytes()[1..]);
        }
        if ctl & 1 == 0 && d.len() >= ICRC_LEN {
            d.truncate(d.len() - ICRC_LEN);
            packet::seal(&flow, &mut d);
        }
        mcast::fuzz_receive(&dev, group, SocketAddr::from((src, 49152)), &d);
    }
    let k = dev.counters();
    assert_eq!(k.wire.rx_packets, list.len() as u64);
    assert!(k.ud_received <= 2 * list.len() as u64, "{k:?}");
    let mut c = c;
    assert!(c.ini.poll_recv_raw().is_none(), "a QP not attached took a datagram");
    dev.detach_all_mcast(&a.qp);
    dev.detach_all_mcast(&b.qp);
    drop((a, b, c));
});
