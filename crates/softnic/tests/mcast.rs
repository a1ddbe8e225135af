//! UD multicast: QPs attached to a group get every datagram sent to it (in process, and over
//! the wire through the group's IPv4 address), a detached QP none, a wrong Q_Key is dropped
//! and counted, a group nobody joined loses the datagram (counted), and attaching checks the
//! GID and the QP type.

use prm::cqe::{Cqe64, CqeOpcode};
use prm::wqe::{CtrlFlags, DatagramSeg, Local, Op, Sge, EXTENDED_UD_AV};
use prm::{Be32, Completion, Lkey};
use softnic::initiator::{Initiator, RingMode};
use softnic::mcast::{McastAttach, MCAST_QPN};
use softnic::*;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

const QKEY: u32 = 0x0123_4567;
const T: Duration = Duration::from_secs(5);

struct Ud {
    qp: Arc<Qp>,
    ini: Initiator,
    buf: Vec<u8>,
    lkey: u32,
}

fn ud(dev: &Device) -> Ud {
    let pd = dev.alloc_pd();
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
    let mut buf = vec![0u8; 1 << 14];
    // SAFETY: `buf` lives in the returned struct, which the tests drop before the device.
    let mr = unsafe {
        dev.reg_host(
            pd,
            buf.as_mut_ptr() as u64,
            buf.len() as u64,
            Access::LOCAL_WRITE,
        )
        .unwrap()
    };
    let ini = Initiator::for_soft_qp(dev, &qp, RingMode::RdmaCore);
    Ud {
        qp,
        ini,
        buf,
        lkey: mr.key,
    }
}

impl Ud {
    fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.buf.as_ptr() as u64 + off as u64,
            len,
            lkey: Lkey(self.lkey),
        }
    }
    /// Sends `len` bytes (a pattern of `seed`) to group `mgid` with `qkey`.
    fn send(&mut self, mgid: Gid, len: u32, qkey: u32, seed: u8) {
        for (i, b) in self.buf[..len as usize].iter_mut().enumerate() {
            *b = (i as u8).wrapping_add(seed);
        }
        let av = DatagramSeg {
            qkey: Be32::new(qkey),
            dqp_dct: Be32::new(MCAST_QPN | EXTENDED_UD_AV),
            hop_limit: 64,
            rgid: mgid.0,
            ..Default::default()
        };
        let sge = [self.sge(0, len)];
        let op = Op::Send {
            local: Local::Sges(&sge),
            imm: None,
        };
        self.ini
            .post_with_av(&op, CtrlFlags::SIGNALED, &av)
            .unwrap();
        self.ini.ring();
        let c = self.ini.wait_send(T).unwrap();
        assert!(matches!(c, Completion::Req { .. }), "{c:?}");
    }
    fn recv(&mut self) {
        let s = self.sge(8192, 8192);
        self.ini.post_recv(&[s]).unwrap();
    }
    fn wait_recv(&mut self, within: Duration) -> Option<Cqe64> {
        let end = Instant::now() + within;
        loop {
            if let Some(c) = self.ini.poll_recv_raw() {
                return Some(c);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    /// A receive of `len` bytes of `seed`'s pattern from `src_qpn`, the GRH naming `group`.
    fn check(&mut self, src_qpn: u32, group: Ipv4Addr, len: usize, seed: u8) {
        let c = self.wait_recv(T).expect("a multicast receive");
        assert_eq!(c.op_own >> 4, CqeOpcode::RespSend as u8, "{c:?}");
        assert_eq!(c.byte_cnt.get() as usize, 40 + len);
        assert_eq!(c.flags_rqpn.get() & 0xff_ffff, src_qpn, "source QPN");
        let ip = &self.buf[8192 + 20..8192 + 40];
        assert_eq!(
            &ip[16..20],
            &group.octets(),
            "the GRH's destination is the group"
        );
        for i in 0..len {
            assert_eq!(self.buf[8192 + 40 + i], (i as u8).wrapping_add(seed));
        }
    }
}

fn group(n: u8) -> (Ipv4Addr, Gid) {
    let g = Ipv4Addr::new(239, 47, 0, n);
    (g, Gid::from_ipv4(g))
}

#[test]
fn two_attached_qps_get_it_a_detached_one_does_not_a_wrong_qkey_is_dropped() {
    let dev = Device::open(DeviceConfig::default()).unwrap();
    let (ip, mgid) = group(1);
    let mut tx = ud(&dev);
    let (mut r1, mut r2) = (ud(&dev), ud(&dev));
    dev.attach_mcast(&r1.qp, mgid, McastAttach::default())
        .unwrap();
    dev.attach_mcast(&r2.qp, mgid, McastAttach::default())
        .unwrap();
    // attaching again is a no-op, as uverbs answers it
    dev.attach_mcast(&r2.qp, mgid, McastAttach::default())
        .unwrap();
    r1.recv();
    r2.recv();
    tx.send(mgid, 300, QKEY, 7);
    r1.check(tx.qp.qpn(), ip, 300, 7);
    r2.check(tx.qp.qpn(), ip, 300, 7);

    // r2 leaves: only r1 gets the next one
    dev.detach_mcast(&r2.qp, mgid).unwrap();
    assert!(dev.detach_mcast(&r2.qp, mgid).is_err(), "not attached");
    r1.recv();
    r2.recv();
    tx.send(mgid, 64, QKEY, 9);
    r1.check(tx.qp.qpn(), ip, 64, 9);
    assert!(r2.wait_recv(Duration::from_millis(200)).is_none());

    // a wrong Q_Key: dropped at r1 and counted
    let before = dev.counters().ud_qkey_drops;
    tx.send(mgid, 16, QKEY ^ 1, 3);
    assert!(r1.wait_recv(Duration::from_millis(200)).is_none());
    assert_eq!(dev.counters().ud_qkey_drops, before + 1);

    // a group nobody joined: lost, counted on the sender's device
    let before = dev.counters().ud_unready_drops;
    tx.send(group(2).1, 16, QKEY, 3);
    assert_eq!(dev.counters().ud_unready_drops, before + 1);
    assert!(r1.wait_recv(Duration::from_millis(100)).is_none());
}

#[test]
fn the_sender_gets_its_own_datagram_unless_it_blocks_self_loopback() {
    let dev = Device::open(DeviceConfig::default()).unwrap();
    let (ip, mgid) = group(3);
    let mut a = ud(&dev);
    let mut b = ud(&dev);
    dev.attach_mcast(&a.qp, mgid, McastAttach::default())
        .unwrap();
    let block = McastAttach {
        block_self_loopback: true,
    };
    dev.attach_mcast(&b.qp, mgid, block).unwrap();
    a.recv();
    b.recv();
    a.send(mgid, 32, QKEY, 1);
    a.check(a.qp.qpn(), ip, 32, 1);
    b.check(a.qp.qpn(), ip, 32, 1);
    a.recv();
    b.recv();
    b.send(mgid, 32, QKEY, 2);
    a.check(b.qp.qpn(), ip, 32, 2);
    assert!(b.wait_recv(Duration::from_millis(200)).is_none());
}

#[test]
fn attach_checks_the_gid_and_the_qp_type() {
    let dev = Device::open(DeviceConfig::default()).unwrap();
    let u = ud(&dev);
    let unicast = Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1));
    assert!(dev
        .attach_mcast(&u.qp, unicast, McastAttach::default())
        .is_err());
    let mut ff = [0u8; 16];
    ff[0] = 0xff;
    ff[15] = 1;
    dev.attach_mcast(&u.qp, Gid(ff), McastAttach::default())
        .unwrap();
    let pd = dev.alloc_pd();
    let cq = dev
        .create_cq(CqConfig {
            ncqe: 16,
            ..Default::default()
        })
        .unwrap();
    let rc = dev.create_qp(QpConfig::new(pd, cq.clone(), cq)).unwrap();
    assert!(dev
        .attach_mcast(&rc, Gid(ff), McastAttach::default())
        .is_err());
}

fn wire_dev(last: u8) -> Device {
    let bind = SocketAddr::from(([127, 0, 233, last], 4791));
    Device::open(DeviceConfig {
        wire: Some(WireConfig::new(bind)),
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn over_the_wire_through_the_group_address() {
    let (a, b) = (wire_dev(1), wire_dev(2));
    let (ip, mgid) = group(4);
    let mut tx = ud(&a);
    let (mut r1, mut r2) = (ud(&b), ud(&b));
    b.attach_mcast(&r1.qp, mgid, McastAttach::default())
        .unwrap();
    b.attach_mcast(&r2.qp, mgid, McastAttach::default())
        .unwrap();
    r1.recv();
    r2.recv();
    tx.send(mgid, 1000, QKEY, 5);
    r1.check(tx.qp.qpn(), ip, 1000, 5);
    r2.check(tx.qp.qpn(), ip, 1000, 5);
    // the sender's device joined nothing: its wire saw no datagram of the group
    assert_eq!(a.counters().wire.rx_unknown_qp, 0);

    // both detached: B leaves the group, and nothing arrives
    b.detach_mcast(&r1.qp, mgid).unwrap();
    b.detach_all_mcast(&r2.qp);
    std::thread::sleep(Duration::from_millis(300));
    r1.recv();
    tx.send(mgid, 10, QKEY, 6);
    assert!(r1.wait_recv(Duration::from_millis(300)).is_none());
}

#[test]
fn a_datagram_longer_than_the_ports_mtu_fails_with_local_length() {
    // on `lo` (MTU 65536) the port MTU is 4096: a 4096-byte datagram goes, 4097 does not
    let a = wire_dev(3);
    let (_, mgid) = group(5);
    let mut tx = ud(&a);
    tx.send(mgid, 4096, QKEY, 1);
    for (i, b) in tx.buf[..4097].iter_mut().enumerate() {
        *b = i as u8;
    }
    let av = DatagramSeg {
        qkey: Be32::new(QKEY),
        dqp_dct: Be32::new(MCAST_QPN | EXTENDED_UD_AV),
        hop_limit: 64,
        rgid: mgid.0,
        ..Default::default()
    };
    let sge = [tx.sge(0, 4097)];
    let op = Op::Send {
        local: Local::Sges(&sge),
        imm: None,
    };
    tx.ini.post_with_av(&op, CtrlFlags::SIGNALED, &av).unwrap();
    tx.ini.ring();
    match tx.ini.wait_send(T).unwrap() {
        Completion::Error(e) => {
            assert_eq!(e.syndrome(), Some(prm::Syndrome::LocalLength), "{e}")
        }
        c => panic!("{c:?}"),
    }
}
