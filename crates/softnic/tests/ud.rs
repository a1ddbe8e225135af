//! UD QPs: datagrams in process (two devices, one device to itself) and over the wire (two
//! devices with UDP ports): SEND and SEND_IMM with the GRH and CQE fields a ConnectX gives,
//! Q_Key mismatch and missing receives dropped and counted, too long and RDMA opcodes failed.

use prm::cqe::{Cqe64, CqeOpcode};
use prm::wqe::{CtrlFlags, DatagramSeg, Local, Op, RemoteAddr, Sge, EXTENDED_UD_AV};
use prm::{Be32, Completion, Lkey, Rkey, Syndrome};
use softnic::initiator::{Initiator, RingMode};
use softnic::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

const QKEY: u32 = 0x1111_1111;
const T: Duration = Duration::from_secs(5);

struct Ud {
    dev: Device,
    qp: Arc<Qp>,
    ini: Initiator,
    buf: Vec<u8>,
    lkey: u32,
}

fn wire_dev() -> Device {
    Device::open(DeviceConfig {
        wire: Some(WireConfig::loopback()),
        ..Default::default()
    })
    .unwrap()
}

fn ud(dev: Device, qkey: u32) -> Ud {
    let pd = dev.alloc_pd();
    let cq = |d: &Device| {
        d.create_cq(CqConfig {
            ncqe: 64,
            ..Default::default()
        })
        .unwrap()
    };
    let (scq, rcq) = (cq(&dev), cq(&dev));
    let mut cfg = QpConfig::new(pd, scq, rcq);
    cfg.rq_wqes = 16;
    let qp = dev.create_ud_qp(cfg, None).unwrap();
    qp.modify(Modify::InitUd { qkey }).unwrap();
    qp.modify(Modify::RtrUd).unwrap();
    qp.modify(Modify::Rts(RtsAttr {
        sq_psn: 0x12,
        ..RtsAttr::default()
    }))
    .unwrap();
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` lives in the returned struct as long as the device.
    let mr = unsafe {
        dev.reg_host(
            pd,
            buf.as_mut_ptr() as u64,
            buf.len() as u64,
            Access::LOCAL_WRITE,
        )
        .unwrap()
    };
    let ini = Initiator::for_soft_qp(&dev, &qp, RingMode::RdmaCore);
    Ud {
        dev,
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
    fn av(&self, to: &Ud, qkey: u32) -> DatagramSeg {
        DatagramSeg {
            qkey: Be32::new(qkey),
            dqp_dct: Be32::new(to.qp.qpn() | EXTENDED_UD_AV),
            hop_limit: 64,
            rgid: to.dev.gid().0,
            ..Default::default()
        }
    }
    /// Posts a SEND (or SEND_IMM) of `len` bytes at offset 0 to `to`.
    fn send(&mut self, to: &Ud, len: u32, imm: Option<u32>, qkey: u32) -> Completion {
        let av = self.av(to, qkey);
        // a zero-length message has no data segment (byte count 0 means 2 GiB), as libmlx5
        // posts it
        let sge = [self.sge(0, len)];
        let n = if len == 0 { 0 } else { 1 };
        let op = Op::Send {
            local: Local::Sges(&sge[..n]),
            imm,
        };
        self.ini
            .post_with_av(&op, CtrlFlags::SIGNALED, &av)
            .unwrap();
        self.ini.ring();
        self.ini.wait_send(T).unwrap()
    }
    fn recv(&mut self, off: usize, len: u32) {
        let s = self.sge(off, len);
        self.ini.post_recv(&[s]).unwrap();
    }
    fn wait_recv_raw(&mut self) -> Cqe64 {
        let end = Instant::now() + T;
        loop {
            if let Some(c) = self.ini.poll_recv_raw() {
                return c;
            }
            assert!(Instant::now() < end, "no receive completion");
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    /// Waits until `f` holds on this device's counters.
    fn wait_counter(&self, f: impl Fn(&CounterSnapshot) -> bool) -> CounterSnapshot {
        let end = Instant::now() + T;
        loop {
            let c = self.dev.counters();
            if f(&c) {
                return c;
            }
            assert!(Instant::now() < end, "counter never reached: {c:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn fill(u: &mut Ud, len: usize, seed: u8) {
    for (i, b) in u.buf[..len].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// Checks a good UD receive: CQE fields, the GRH (IPv4 header in its last 20 bytes) and the
/// payload.
fn check_recv(c: &Cqe64, rx: &Ud, tx: &Ud, off: usize, len: usize, imm: Option<u32>, seed: u8) {
    let op = if imm.is_some() {
        CqeOpcode::RespSendImm
    } else {
        CqeOpcode::RespSend
    };
    assert_eq!(c.op_own >> 4, op as u8, "{c:?}");
    assert_eq!(c.byte_cnt.get() as usize, 40 + len);
    let f = c.flags_rqpn.get();
    assert_eq!(f & 0xff_ffff, tx.qp.qpn(), "source QPN");
    assert_ne!((f >> 28) & 3, 0, "GRH bit");
    assert_eq!((f >> 24) & 3, 2, "RoCE L3 type IPv4");
    assert_eq!((c.l4_hdr_type_etc >> 2) & 3, 2, "l3_hdr_type IPv4");
    assert_eq!(c.sop_drop_qpn.get() & 0xff_ffff, rx.qp.qpn());
    if let Some(i) = imm {
        assert_eq!(c.imm_inval_pkey.get(), i);
    }
    let grh = &rx.buf[off..off + 40];
    assert!(grh[..20].iter().all(|&b| b == 0), "{grh:?}");
    let ip = &grh[20..];
    assert_eq!(ip[0], 0x45);
    assert_eq!(ip[9], 17);
    assert_eq!(&ip[12..16], &tx.dev.gid().0[12..]);
    assert_eq!(&ip[16..20], &rx.dev.gid().0[12..]);
    let mut sum = 0u32;
    for w in ip.chunks(2) {
        sum += u16::from_be_bytes([w[0], w[1]]) as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    assert_eq!(sum, 0xffff, "IPv4 header checksum");
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    let udp = 12 + 8 + if imm.is_some() { 4 } else { 0 } + len.div_ceil(4) * 4 + 4;
    assert_eq!(total, 20 + 8 + udp);
    for i in 0..len {
        assert_eq!(
            rx.buf[off + 40 + i],
            (i as u8).wrapping_mul(31).wrapping_add(seed),
            "payload byte {i}"
        );
    }
}

/// The whole UD behaviour between `a` (sender) and `b` (receiver).
fn exercise(mut a: Ud, mut b: Ud, wire: bool) {
    // SEND and SEND_IMM, sizes up to the MTU
    for (k, len) in [0usize, 1, 100, 1024, 4096].into_iter().enumerate() {
        let seed = k as u8 + 1;
        fill(&mut a, len, seed);
        b.recv(8192, 8192);
        let imm = (k % 2 == 1).then_some(0xa0b0_c0d0 + k as u32);
        let c = a.send(&b, len as u32, imm, QKEY);
        assert!(matches!(c, Completion::Req { .. }), "{c:?}");
        let r = b.wait_recv_raw();
        check_recv(&r, &b, &a, 8192, len, imm, seed);
    }
    // the QP's own Q_Key when the WQE's has its high bit set
    fill(&mut a, 10, 9);
    b.recv(8192, 100);
    a.send(&b, 10, None, 0x8000_0000);
    let r = b.wait_recv_raw();
    check_recv(&r, &b, &a, 8192, 10, None, 9);
    // a wrong Q_Key: dropped and counted, the next receive is still posted
    let before = b.dev.counters();
    b.recv(8192, 100);
    let c = a.send(&b, 10, None, 0x2222);
    assert!(matches!(c, Completion::Req { .. }), "{c:?}");
    b.wait_counter(|c| c.ud_qkey_drops == before.ud_qkey_drops + 1);
    assert!(b.ini.poll_recv_raw().is_none());
    // the posted receive takes the next good datagram
    fill(&mut a, 5, 3);
    a.send(&b, 5, Some(7), QKEY);
    let r = b.wait_recv_raw();
    check_recv(&r, &b, &a, 8192, 5, Some(7), 3);
    // no receive posted: dropped and counted (no RNR), the sender completes
    let before = b.dev.counters();
    let c = a.send(&b, 10, None, QKEY);
    assert!(matches!(c, Completion::Req { .. }), "{c:?}");
    b.wait_counter(|c| c.ud_no_recv_drops == before.ud_no_recv_drops + 1);
    // longer than the MTU: LOCAL_LENGTH at the sender, QP to ERR
    let c = a.send(&b, 4097, None, QKEY);
    match c {
        Completion::Error(e) => assert_eq!(e.syndrome(), Some(Syndrome::LocalLength), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.qp.state(), QpState::Err);
    // a receive buffer too short for GRH + payload: LOCAL_LENGTH at the receiver
    b.recv(8192, 40 + 9);
    let mut c2 = ud(fresh(wire), QKEY);
    if wire {
        c2.dev
            .add_peer(b.dev.gid(), b.dev.wire_addr().unwrap())
            .unwrap();
    }
    fill(&mut c2, 10, 1);
    let c = c2.send(&b, 10, None, QKEY);
    assert!(matches!(c, Completion::Req { .. }), "{c:?}");
    let r = b.wait_recv_raw();
    assert_eq!(r.op_own >> 4, CqeOpcode::RespErr as u8, "{r:?}");
    assert_eq!(
        bytemuck::bytes_of(&r)[prm::cqe::ERR_SYNDROME_OFFSET],
        Syndrome::LocalLength as u8
    );
    if wire {
        // everything above went as packets
        assert!(a.dev.counters().wire.tx_packets >= 9);
        assert!(b.dev.counters().wire.rx_packets >= 10);
    } else {
        assert_eq!(a.dev.counters().wire.tx_packets, 0);
    }
    assert!(b.dev.counters().ud_received >= 8);
    // an RDMA WRITE on a UD QP: LOCAL_QP_OP
    let sge = [c2.sge(0, 8)];
    let w = Op::Write {
        remote: RemoteAddr {
            addr: 0x1000,
            rkey: Rkey(1),
        },
        local: Local::Sges(&sge),
        imm: None,
    };
    c2.ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    match c2.ini.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome(), Some(Syndrome::LocalQpOp), "{e}"),
        other => panic!("{other:?}"),
    }
}

fn fresh(wire: bool) -> Device {
    if wire {
        wire_dev()
    } else {
        Device::open(DeviceConfig::default()).unwrap()
    }
}

#[test]
fn ud_between_two_devices_in_process() {
    let a = ud(fresh(false), QKEY);
    let b = ud(fresh(false), QKEY);
    exercise(a, b, false);
}

#[test]
fn ud_over_the_wire() {
    let a = ud(wire_dev(), QKEY);
    let b = ud(wire_dev(), QKEY);
    // both GIDs are ::ffff:127.0.0.1: the peer tables tell the ports apart
    a.dev
        .add_peer(b.dev.gid(), b.dev.wire_addr().unwrap())
        .unwrap();
    b.dev
        .add_peer(a.dev.gid(), a.dev.wire_addr().unwrap())
        .unwrap();
    exercise(a, b, true);
}

#[test]
fn ud_to_itself_and_from_any_source() {
    // one device, two UD QPs and a QP sending to itself
    let dev = Device::open(DeviceConfig::default()).unwrap();
    let mut a = ud(dev, QKEY);
    fill(&mut a, 64, 5);
    a.recv(16384, 1000);
    // to itself: the AV names its own device and QPN
    let me = Ud {
        dev: Device::open(DeviceConfig::default()).unwrap(),
        qp: a.qp.clone(),
        ini: Initiator::for_soft_qp(&a.dev, &a.qp, RingMode::RdmaCore),
        buf: Vec::new(),
        lkey: 0,
    };
    let av = DatagramSeg {
        rgid: a.dev.gid().0,
        ..me.av(&me, QKEY)
    };
    drop(me);
    let sge = [a.sge(0, 64)];
    let op = Op::Send {
        local: Local::Sges(&sge),
        imm: None,
    };
    a.ini.post_with_av(&op, CtrlFlags::SIGNALED, &av).unwrap();
    a.ini.ring();
    a.ini.wait_send(T).unwrap();
    let c = a.wait_recv_raw();
    assert_eq!(c.byte_cnt.get(), 40 + 64);
    assert_eq!(c.flags_rqpn.get() & 0xff_ffff, a.qp.qpn());
    assert_eq!(
        &a.buf[16384 + 40..16384 + 40 + 64],
        &a.buf[..64].to_vec()[..]
    );
    // a UD QP not yet in RTR drops what arrives
    let b = {
        let dev = Device::open(DeviceConfig::default()).unwrap();
        let pd = dev.alloc_pd();
        let cq = dev
            .create_cq(CqConfig {
                ncqe: 8,
                ..Default::default()
            })
            .unwrap();
        let qp = dev
            .create_ud_qp(QpConfig::new(pd, cq.clone(), cq), None)
            .unwrap();
        qp.modify(Modify::InitUd { qkey: QKEY }).unwrap();
        // RC attributes are refused on a UD QP
        assert!(qp
            .modify(Modify::Init {
                access: Access::NONE
            })
            .is_err());
        (dev, qp)
    };
    let av = DatagramSeg {
        qkey: Be32::new(QKEY),
        dqp_dct: Be32::new(b.1.qpn() | EXTENDED_UD_AV),
        rgid: b.0.gid().0,
        ..Default::default()
    };
    a.ini.post_with_av(&op, CtrlFlags::SIGNALED, &av).unwrap();
    a.ini.ring();
    a.ini.wait_send(T).unwrap();
    assert_eq!(b.0.counters().ud_unready_drops, 1);
}
