//! The host API's DC transport on the soft backend: a DC target on one device, a DC
//! initiator on another, the target handed over as serialized [`DcTarget`] JSON; WRITE, READ
//! and fetch-add through the CPU initiator with the target's address vector; the wrong key
//! (TRANSPORT_RETRY_EXC), a SEND (no receive queue: RNR), and the same over the wire between
//! two soft NICs with UDP ports (the initiator reaches the target through [`Qp::reach`]).

use gpuverbs::post::{Completion, CpuInitiator, CtrlFlags, Local, Op, Opcode, RingMode, Syndrome};
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DcTarget, Dct, DctOptions, HostBuffer, Mr,
    QpOptions, QpState,
};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
const KEY: u64 = 0x1ee7_a330;

struct Target {
    _ctx: Context,
    dct: Dct,
    buf: HostBuffer,
    mr: Mr,
}

fn target(ctx: Context) -> Target {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let dct = pd.create_dct(&cq, DctOptions::new(KEY)).unwrap();
    assert_eq!(dct.state(), QpState::Rtr);
    let buf = HostBuffer::new(1 << 16);
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mr = pd.register_with(&buf, all).unwrap();
    Target {
        _ctx: ctx,
        dct,
        buf,
        mr,
    }
}

struct Initiator {
    _ctx: Context,
    qp: gpuverbs::Qp,
    buf: HostBuffer,
    mr: Mr,
}

fn initiator(ctx: Context, retry_cnt: u8, rnr_retry: u8) -> Initiator {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let c = ConnectOptions {
        timeout: 12,
        retry_cnt,
        rnr_retry,
        ..Default::default()
    };
    let qp = pd.create_dci(QpOptions::new(&cq, &cq), c).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    let buf = HostBuffer::new(1 << 16);
    let mr = pd.register_with(&buf, Access::LOCAL_WRITE).unwrap();
    Initiator {
        _ctx: ctx,
        qp,
        buf,
        mr,
    }
}

/// The target as its owner sends it: JSON, decoded on the initiator's side.
fn handed_over(t: &Target) -> DcTarget {
    let json = serde_json::to_vec(&t.dct.target()).unwrap();
    serde_json::from_slice(&json).unwrap()
}

fn post(ini: &mut CpuInitiator, op: Op<'_>, to: &DcTarget) -> u16 {
    let i = ini
        .post_with_av(&op, CtrlFlags::SIGNALED, &to.address_vector())
        .unwrap();
    ini.ring();
    i
}

fn expect(ini: &mut CpuInitiator, opcode: Opcode, idx: u16) {
    match ini.wait_send(T).unwrap() {
        Completion::Req {
            wqe_opcode,
            wqe_counter,
            ..
        } if (wqe_opcode, wqe_counter) == (opcode as u8, idx) => {}
        c => panic!("expected {opcode:?} #{idx}, got {c:?}"),
    }
}

fn expect_err(ini: &mut CpuInitiator, syndrome: Syndrome) {
    match ini.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome, syndrome as u8, "{e:?}"),
        c => panic!("expected {syndrome:?}, got {c:?}"),
    }
}

/// WRITE, READ and fetch-add from `a` to `t`, every byte checked.
fn traffic(a: &Initiator, t: &Target, to: &DcTarget) {
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 7) as u8).collect();
    a.buf.write(0, &data);
    let w = post(
        &mut ini,
        Op::Write {
            remote: t.mr.remote(0),
            local: Local::Sges(&[a.mr.sge(0, 8192)]),
            imm: None,
        },
        to,
    );
    expect(&mut ini, Opcode::RdmaWrite, w);
    assert_eq!(&t.buf.to_vec()[..8192], &data[..]);
    let r = post(
        &mut ini,
        Op::Read {
            remote: t.mr.remote(0),
            local: &[a.mr.sge(16384, 8192)],
        },
        to,
    );
    expect(&mut ini, Opcode::RdmaRead, r);
    assert_eq!(&a.buf.to_vec()[16384..16384 + 8192], &data[..]);
    t.buf.write(32768, &41u64.to_ne_bytes());
    let f = post(
        &mut ini,
        Op::FetchAdd {
            remote: t.mr.remote(32768),
            add: 1,
            result: a.mr.sge(32768, 8),
        },
        to,
    );
    expect(&mut ini, Opcode::AtomicFa, f);
    assert_eq!(&a.buf.to_vec()[32768..32776], &41u64.to_ne_bytes());
    assert_eq!(&t.buf.to_vec()[32768..32776], &42u64.to_ne_bytes());
}

#[test]
fn a_dc_initiator_reaches_a_target_by_its_handed_over_address() {
    let t = target(Context::open_soft(Default::default()).unwrap());
    let a = initiator(Context::open_soft(Default::default()).unwrap(), 0, 0);
    let to = handed_over(&t);
    assert_eq!((to.dctn, to.key, to.udp_port), (t.dct.number(), KEY, None));
    a.qp.reach(&to).unwrap();
    traffic(&a, &t, &to);
    // a SEND: the target posts no receives, so RNR ends it (rnr_retry 0)
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    post(
        &mut ini,
        Op::Send {
            local: Local::Sges(&[a.mr.sge(0, 8)]),
            imm: None,
        },
        &to,
    );
    expect_err(&mut ini, Syndrome::RnrRetryExc);
    drop(ini);
    // the wrong key: the target stays silent, the initiator's timer ends it
    let b = initiator(Context::open_soft(Default::default()).unwrap(), 0, 0);
    let mut ini = b.qp.cpu_initiator(RingMode::RdmaCore);
    let wrong = DcTarget { key: !KEY, ..to };
    post(
        &mut ini,
        Op::Write {
            remote: t.mr.remote(0),
            local: Local::Sges(&[b.mr.sge(0, 64)]),
            imm: None,
        },
        &wrong,
    );
    expect_err(&mut ini, Syndrome::TransportRetryExc);
    assert_eq!(b.qp.state(), QpState::Err);
    assert_eq!(t.dct.state(), QpState::Rtr);
}

#[test]
fn dc_between_two_soft_nics_on_the_wire() {
    let wire = || {
        Context::open_soft(gpuverbs::soft::DeviceConfig {
            wire: Some(gpuverbs::soft::WireConfig::new(SocketAddr::from((
                Ipv4Addr::LOCALHOST,
                0,
            )))),
            ..Default::default()
        })
        .unwrap()
    };
    let t = target(wire());
    let a = initiator(wire(), 7, 7);
    let to = handed_over(&t);
    assert!(
        to.udp_port.is_some(),
        "a soft NIC on the wire names its port"
    );
    a.qp.reach(&to).unwrap();
    traffic(&a, &t, &to);
    let sent = a._ctx.soft_device().unwrap().counters().wire.tx_packets;
    assert!(sent > 0, "the wire carried it");
}
