//! The connection manager in one process: two emulated devices (127.0.230.1 and .2, their soft
//! NICs' wire ports on UDP 4791), a listener on one and a connecting id on the other, each on
//! its own event channel, driven by the ucma commands librdmacm writes; the CM messages go over
//! the devices' wire ports. And the kernel's answers to commands out of turn or out of shape.

use super::abi::{self, cmd, event, ConnParam, EventResp, QpAttr};
use super::{cm, Cm, CmFile};
use crate::config::EmuConfig;
use crate::device::Devices;
use crate::uaccess::Errno;
use std::net::Ipv4Addr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

fn manager() -> &'static Cm {
    static DEVICES: OnceLock<&'static Devices> = OnceLock::new();
    let d = DEVICES.get_or_init(|| {
        Box::leak(Box::new(Devices::new(EmuConfig {
            ip: Ipv4Addr::new(127, 0, 230, 1),
            port: 4791,
            devices: 2,
            static_uars: false,
        })))
    });
    cm(d)
}

fn file() -> Arc<CmFile> {
    CmFile::new(libc::O_NONBLOCK | libc::O_CLOEXEC).expect("eventfd")
}

/// Writes command `c` with `body` and `out` bytes of response room.
fn write(f: &Arc<CmFile>, c: u32, body: &[u8], out: usize) -> Result<(), Errno> {
    let mut b = Vec::new();
    b.extend_from_slice(&c.to_ne_bytes());
    b.extend_from_slice(&(body.len() as u16).to_ne_bytes());
    b.extend_from_slice(&(out as u16).to_ne_bytes());
    b.extend_from_slice(body);
    manager().write(f, &b, &|_| None)
}

fn ptr<T>(v: &mut T) -> u64 {
    v as *mut T as u64
}

fn create(f: &Arc<CmFile>, ps: u16, uid: u64) -> u32 {
    let mut id = 0u32;
    let c = abi::CreateId {
        uid,
        response: ptr(&mut id),
        ps,
        qp_type: 0,
        reserved: [0; 5],
    };
    write(f, cmd::CREATE_ID, bytemuck::bytes_of(&c), 4).expect("CREATE_ID");
    id
}

fn sockaddr(ip: [u8; 4], port: u16) -> [u8; 128] {
    let mut a = [0u8; 128];
    a[..2].copy_from_slice(&2u16.to_ne_bytes());
    a[2..4].copy_from_slice(&port.to_be_bytes());
    a[4..8].copy_from_slice(&ip);
    a
}

fn bind(f: &Arc<CmFile>, id: u32, ip: [u8; 4], port: u16) -> Result<(), Errno> {
    let b = abi::Bind {
        id,
        addr_size: 16,
        reserved: 0,
        addr: sockaddr(ip, port),
    };
    write(f, cmd::BIND, bytemuck::bytes_of(&b), 0)
}

/// The next event of `f`, waiting up to 3 s.
fn next_event(f: &Arc<CmFile>) -> EventResp {
    let mut e: EventResp = bytemuck::Zeroable::zeroed();
    let t = Instant::now();
    loop {
        let p = ptr(&mut e);
        match write(f, cmd::GET_EVENT, &p.to_ne_bytes(), 336) {
            Ok(()) => return e,
            Err(Errno::EAGAIN) if t.elapsed() < Duration::from_secs(3) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("GET_EVENT: {e:?}"),
        }
    }
}

fn conn(e: &EventResp) -> ConnParam {
    let mut b = [0u8; 272];
    b[..256].copy_from_slice(&e.param);
    b[256..].copy_from_slice(&e.param_tail[..16]);
    bytemuck::pod_read_unaligned(&b)
}

fn qp_attr(f: &Arc<CmFile>, id: u32, state: u32) -> QpAttr {
    let mut a: QpAttr = bytemuck::Zeroable::zeroed();
    let q = abi::RespIdAnd32 {
        response: ptr(&mut a),
        id,
        value: state,
    };
    write(f, cmd::INIT_QP_ATTR, bytemuck::bytes_of(&q), 144).expect("INIT_QP_ATTR");
    a
}

fn params(qp_num: u32, private: &[u8]) -> ConnParam {
    let mut p: ConnParam = bytemuck::Zeroable::zeroed();
    p.qp_num = qp_num;
    p.private_data[..private.len()].copy_from_slice(private);
    p.private_data_len = private.len() as u8;
    p.responder_resources = 4;
    p.initiator_depth = 2;
    p.retry_count = 7;
    p.rnr_retry_count = 6;
    p.valid = 1;
    p
}

fn destroy(f: &Arc<CmFile>, id: u32) -> u32 {
    let mut n = 0u32;
    let d = abi::Destroy {
        response: ptr(&mut n),
        handle: id,
        reserved: 0,
    };
    write(f, cmd::DESTROY_ID, bytemuck::bytes_of(&d), 4).expect("DESTROY_ID");
    n
}

/// A listener on the first file (at `port`) and a client on the second that connects to it, up to the
/// server's ACCEPT (the REP sent): (listener, client, the server's new id, the server's RTR
/// attributes).
fn connect_until_rep(sf: &Arc<CmFile>, cf: &Arc<CmFile>, port: u16) -> (u32, u32, u32, QpAttr) {
    let listener = create(sf, abi::ps::TCP, 0x1111);
    bind(sf, listener, [127, 0, 230, 1], port).expect("BIND");
    let l = abi::IdAnd32 {
        id: listener,
        value: 8,
    };
    write(sf, cmd::LISTEN, bytemuck::bytes_of(&l), 0).expect("LISTEN");

    // the client: resolve the address and route, then connect
    let client = create(cf, abi::ps::TCP, 0x2222);
    let mut r: abi::ResolveAddr = bytemuck::Zeroable::zeroed();
    r.id = client;
    // from the second device (without a source, the first: the destination's own)
    r.src_size = 16;
    r.src_addr = sockaddr([127, 0, 230, 2], 0);
    r.dst_size = 16;
    r.dst_addr = sockaddr([127, 0, 230, 1], port);
    write(cf, cmd::RESOLVE_ADDR, bytemuck::bytes_of(&r), 0).expect("RESOLVE_ADDR");
    let e = next_event(cf);
    assert_eq!(
        (e.event, e.uid, e.id),
        (event::ADDR_RESOLVED, 0x2222, client)
    );
    let rr = abi::IdAnd32 {
        id: client,
        value: 1000,
    };
    write(cf, cmd::RESOLVE_ROUTE, bytemuck::bytes_of(&rr), 0).expect("RESOLVE_ROUTE");
    assert_eq!(next_event(cf).event, event::ROUTE_RESOLVED);
    let c = abi::Connect {
        conn_param: params(0x1234, b"hello"),
        id: client,
        reserved: 0,
        ece_vendor_id: 0,
        ece_attr_mod: 0,
    };
    write(cf, cmd::CONNECT, bytemuck::bytes_of(&c), 0).expect("CONNECT");

    // the server: a new id with the client's parameters, seen from its side
    let e = next_event(sf);
    assert_eq!((e.event, e.uid), (event::CONNECT_REQUEST, 0x1111));
    let child = e.id;
    assert_ne!(child, listener);
    let p = conn(&e);
    assert_eq!(p.qp_num, 0x1234);
    assert_eq!(&p.private_data[..5], b"hello");
    assert_eq!(
        p.private_data_len, 56,
        "the REQ's private data after the CMA header"
    );
    assert_eq!((p.responder_resources, p.initiator_depth), (2, 4));
    let rtr = qp_attr(sf, child, 2);
    assert_eq!(rtr.dest_qp_num, 0x1234);
    assert_eq!(rtr.ah_attr.dgid[10..], [0xff, 0xff, 127, 0, 230, 2]);
    assert_eq!((rtr.ah_attr.is_global, rtr.path_mtu), (1, 5));
    let mut a: abi::Accept = bytemuck::Zeroable::zeroed();
    a.uid = 0x3333;
    a.id = child;
    a.conn_param = params(0x5678, b"welcome");
    write(sf, cmd::ACCEPT, bytemuck::bytes_of(&a), 0).expect("ACCEPT");

    (listener, client, child, rtr)
}

#[test]
fn a_connection_is_made_used_by_the_qp_attributes_and_ended() {
    let (sf, cf) = (file(), file());
    let (listener, client, child, rtr) = connect_until_rep(&sf, &cf, 9100);

    // the client: the REP, then its own transitions and the RTU
    let e = next_event(&cf);
    assert_eq!(e.event, event::CONNECT_RESPONSE);
    assert_eq!(conn(&e).qp_num, 0x5678);
    assert_eq!(&conn(&e).private_data[..7], b"welcome");
    let crtr = qp_attr(&cf, client, 2);
    let crts = qp_attr(&cf, client, 3);
    let srts = qp_attr(&sf, child, 3);
    assert_eq!(crtr.dest_qp_num, 0x5678);
    assert_eq!(
        crtr.rq_psn, srts.sq_psn,
        "each side receives from the other's first PSN"
    );
    assert_eq!(rtr.rq_psn, crts.sq_psn);
    let mut a: abi::Accept = bytemuck::Zeroable::zeroed();
    a.id = client;
    write(&cf, cmd::ACCEPT, bytemuck::bytes_of(&a), 0).expect("ACCEPT (RTU)");
    let e = next_event(&sf);
    assert_eq!((e.event, e.uid, e.id), (event::ESTABLISHED, 0x3333, child));

    // the client disconnects: both see DISCONNECTED once
    write(&cf, cmd::DISCONNECT, &client.to_ne_bytes(), 0).expect("DISCONNECT");
    assert_eq!(next_event(&sf).event, event::DISCONNECTED);
    write(&sf, cmd::DISCONNECT, &child.to_ne_bytes(), 0).expect("DISCONNECT (DREP)");
    assert_eq!(next_event(&cf).event, event::DISCONNECTED);
    assert_eq!(destroy(&cf, client), 4, "four events reported");
    assert_eq!(destroy(&sf, child), 2);
    assert_eq!(destroy(&sf, listener), 1);
}

#[test]
fn commands_out_of_shape_or_turn_get_the_kernels_errors() {
    let (f, g) = (file(), file());
    assert_eq!(
        manager().write(&f, &[0; 4], &|_| None),
        Err(Errno::EINVAL),
        "shorter than the header"
    );
    assert_eq!(write(&f, 99, &[], 0), Err(Errno::EINVAL), "unknown command");
    assert_eq!(write(&f, cmd::CREATE_ID, &[0; 8], 4), Err(Errno::EINVAL));
    let mut id = 0u32;
    let mut c = abi::CreateId {
        uid: 1,
        response: ptr(&mut id),
        ps: abi::ps::TCP,
        qp_type: 0,
        reserved: [0; 5],
    };
    assert_eq!(
        write(&f, cmd::CREATE_ID, bytemuck::bytes_of(&c), 2),
        Err(Errno::ENOSPC)
    );
    c.ps = 0x4242;
    assert_eq!(
        write(&f, cmd::CREATE_ID, bytemuck::bytes_of(&c), 4),
        Err(Errno::EINVAL),
        "no such port space"
    );
    let a = create(&f, abi::ps::TCP, 7);
    let rr = abi::IdAnd32 { id: a, value: 0 };
    assert_eq!(
        write(&f, cmd::RESOLVE_ROUTE, bytemuck::bytes_of(&rr), 0),
        Err(Errno::EINVAL),
        "no address resolved yet"
    );
    assert_eq!(
        write(&g, cmd::RESOLVE_ROUTE, bytemuck::bytes_of(&rr), 0),
        Err(Errno::EINVAL),
        "another file's id"
    );
    let none = abi::IdAnd32 {
        id: 0xdead_beef,
        value: 0,
    };
    assert_eq!(
        write(&f, cmd::RESOLVE_ROUTE, bytemuck::bytes_of(&none), 0),
        Err(Errno::ENOENT)
    );
    assert_eq!(
        bind(&f, a, [10, 9, 8, 7], 9200),
        Err(Errno(libc::EADDRNOTAVAIL)),
        "not an emulated device's address"
    );
    bind(&f, a, [127, 0, 230, 2], 9200).expect("BIND");
    assert_eq!(
        bind(&f, a, [127, 0, 230, 2], 9201),
        Err(Errno::EINVAL),
        "bound"
    );
    let b = create(&f, abi::ps::TCP, 8);
    assert_eq!(
        bind(&f, b, [127, 0, 230, 2], 9200),
        Err(Errno(libc::EADDRINUSE))
    );
    // a loopback address no device has binds no device, as the unspecified one does (the
    // CMA's `cma_any_addr`): it holds its port on every address
    let c = create(&f, abi::ps::TCP, 9);
    bind(&f, c, [127, 0, 0, 1], 9300).expect("BIND localhost");
    let d = create(&f, abi::ps::TCP, 10);
    assert_eq!(
        bind(&f, d, [127, 0, 230, 1], 9300),
        Err(Errno(libc::EADDRINUSE))
    );
    assert_eq!(
        write(&f, cmd::GET_EVENT, &0u64.to_ne_bytes(), 336),
        Err(Errno::EAGAIN),
        "a non-blocking channel without events"
    );
    let q = abi::RespIdAnd32 {
        response: 0,
        id: a,
        value: 7,
    };
    assert_eq!(
        write(&f, cmd::INIT_QP_ATTR, bytemuck::bytes_of(&q), 144),
        Err(Errno::EINVAL),
        "no such QP state"
    );
    assert_eq!(destroy(&f, b), 0);
    assert_eq!(destroy(&f, a), 0);
}

#[test]
fn a_request_nobody_listens_for_is_rejected() {
    let f = file();
    let id = create(&f, abi::ps::TCP, 9);
    let mut r: abi::ResolveAddr = bytemuck::Zeroable::zeroed();
    r.id = id;
    r.dst_size = 16;
    r.dst_addr = sockaddr([127, 0, 230, 2], 9300);
    write(&f, cmd::RESOLVE_ADDR, bytemuck::bytes_of(&r), 0).expect("RESOLVE_ADDR");
    assert_eq!(next_event(&f).event, event::ADDR_RESOLVED);
    write(
        &f,
        cmd::RESOLVE_ROUTE,
        bytemuck::bytes_of(&abi::IdAnd32 { id, value: 0 }),
        0,
    )
    .expect("RESOLVE_ROUTE");
    assert_eq!(next_event(&f).event, event::ROUTE_RESOLVED);
    // the second device's CM has its QP1 up (a listener on another port)
    let g = file();
    let l = create(&g, abi::ps::TCP, 10);
    bind(&g, l, [127, 0, 230, 2], 9301).expect("BIND");
    write(
        &g,
        cmd::LISTEN,
        bytemuck::bytes_of(&abi::IdAnd32 { id: l, value: 1 }),
        0,
    )
    .expect("LISTEN");
    let c = abi::Connect {
        conn_param: params(0x99, b""),
        id,
        reserved: 0,
        ece_vendor_id: 0,
        ece_attr_mod: 0,
    };
    write(&f, cmd::CONNECT, bytemuck::bytes_of(&c), 0).expect("CONNECT");
    let e = next_event(&f);
    assert_eq!(
        (e.event, e.status),
        (event::REJECTED, 8),
        "invalid service ID"
    );
    destroy(&f, id);
    destroy(&g, l);
}

/// NOTIFY with IB_EVENT_COMM_EST (4) on the passive side after its REP: the connection is made
/// without waiting for the RTU (ESTABLISHED once; the RTU that comes later changes nothing);
/// any other event number leaves it waiting.
#[test]
fn comm_est_notified_before_the_rtu_establishes_the_connection() {
    let (sf, cf) = (file(), file());
    let (listener, client, child, _) = connect_until_rep(&sf, &cf, 9101);
    assert_eq!(next_event(&cf).event, event::CONNECT_RESPONSE);
    let notify = |value: u32| {
        let n = abi::IdAnd32 { id: child, value };
        write(&sf, cmd::NOTIFY, bytemuck::bytes_of(&n), 0).expect("NOTIFY");
    };
    // IBV_EVENT_PORT_ACTIVE (9): not a connection event
    notify(9);
    let mut e: EventResp = bytemuck::Zeroable::zeroed();
    let p = ptr(&mut e);
    assert!(
        matches!(
            write(&sf, cmd::GET_EVENT, &p.to_ne_bytes(), 336),
            Err(Errno::EAGAIN)
        ),
        "an event for IBV_EVENT_PORT_ACTIVE"
    );
    notify(4);
    let e = next_event(&sf);
    assert_eq!((e.event, e.id), (event::ESTABLISHED, child));
    let mut a: abi::Accept = bytemuck::Zeroable::zeroed();
    a.id = client;
    write(&cf, cmd::ACCEPT, bytemuck::bytes_of(&a), 0).expect("ACCEPT (RTU)");
    write(&cf, cmd::DISCONNECT, &client.to_ne_bytes(), 0).expect("DISCONNECT");
    assert_eq!(
        next_event(&sf).event,
        event::DISCONNECTED,
        "no second ESTABLISHED for the RTU"
    );
    destroy(&cf, client);
    destroy(&sf, child);
    destroy(&sf, listener);
}

/// A JOIN_MCAST (or JOIN_IP_MCAST) body for `addr`.
fn join_mcast(
    id: u32,
    uid: u64,
    resp: &mut u32,
    addr: [u8; 128],
    size: u16,
    flags: u16,
) -> Vec<u8> {
    let j = abi::JoinMcast {
        response: ptr(resp),
        uid,
        id,
        addr_size: size,
        join_flags: flags,
        addr,
    };
    bytemuck::bytes_of(&j).to_vec()
}

#[test]
fn a_multicast_join_is_answered_with_the_groups_address_vector_and_left() {
    let f = file();
    let ud = create(&f, abi::ps::UDP, 0x55);
    let group = sockaddr([239, 230, 0, 1], 0);
    let mut h = 0u32;
    // no device yet: EINVAL; a short answer room: ENOSPC
    let b = join_mcast(ud, 7, &mut h, group, 16, 0);
    assert_eq!(write(&f, cmd::JOIN_MCAST, &b, 4), Err(Errno::EINVAL));
    assert_eq!(write(&f, cmd::JOIN_MCAST, &b, 2), Err(Errno::ENOSPC));
    bind(&f, ud, [127, 0, 230, 1], 0).unwrap();
    // the kernel's errors: size not the family's, unknown join flags, IPv6 on RoCE v2
    // (ENOTSUPP, 524), 0.0.0.0, a unicast address for a full member
    let bad = [
        (join_mcast(ud, 7, &mut h, group, 28, 0), Errno::EINVAL),
        (join_mcast(ud, 7, &mut h, group, 16, 2), Errno::EINVAL),
        (
            join_mcast(ud, 7, &mut h, sockaddr([0; 4], 0), 16, 0),
            Errno::EINVAL,
        ),
        (
            join_mcast(ud, 7, &mut h, sockaddr([10, 0, 0, 1], 0), 16, 0),
            Errno::EINVAL,
        ),
    ];
    for (b, e) in bad {
        assert_eq!(write(&f, cmd::JOIN_MCAST, &b, 4), Err(e));
    }
    let mut v6 = [0u8; 128];
    v6[..2].copy_from_slice(&10u16.to_ne_bytes());
    v6[8] = 0xff;
    let b = join_mcast(ud, 7, &mut h, v6, 28, 0);
    assert_eq!(write(&f, cmd::JOIN_MCAST, &b, 4), Err(Errno(524)));
    // an RC id: EINVAL
    let rc = create(&f, abi::ps::TCP, 0x56);
    bind(&f, rc, [127, 0, 230, 1], 0).unwrap();
    let b = join_mcast(rc, 7, &mut h, group, 16, 0);
    assert_eq!(write(&f, cmd::JOIN_MCAST, &b, 4), Err(Errno::EINVAL));

    // the join: the group's handle, then MULTICAST_JOIN with the group's uid and handle
    let b = join_mcast(ud, 0x1234, &mut h, group, 16, 0);
    write(&f, cmd::JOIN_MCAST, &b, 4).unwrap();
    assert_ne!(h, 0);
    let e = next_event(&f);
    assert_eq!(
        (e.event, e.status, e.uid, e.id),
        (event::MULTICAST_JOIN, 0, 0x1234, h)
    );
    let mut raw = [0u8; 304];
    raw[..256].copy_from_slice(&e.param);
    raw[256..].copy_from_slice(&e.param_tail);
    let u: abi::UdParam = bytemuck::pod_read_unaligned(&raw);
    assert_eq!((u.qp_num, u.qkey), (0xff_ffff, 0x0123_4567));
    let mgid = verbs::Gid::from_ipv4(Ipv4Addr::new(239, 230, 0, 1)).0;
    assert_eq!(u.ah_attr.dgid, mgid);
    assert_eq!(
        (u.ah_attr.is_global, u.ah_attr.hop_limit, u.ah_attr.port_num),
        (1, 64, 1)
    );
    assert_eq!((u.ah_attr.sgid_index, u.ah_attr.dlid), (0, 0));

    // JOIN_IP_MCAST (a sockaddr_in6-sized address) gives another group
    let mut h2 = 0u32;
    let mut ip = abi::JoinIpMcast {
        response: ptr(&mut h2),
        uid: 0x99,
        addr: [0; 28],
        id: ud,
    };
    ip.addr
        .copy_from_slice(&sockaddr([239, 230, 0, 2], 0)[..28]);
    write(&f, cmd::JOIN_IP_MCAST, bytemuck::bytes_of(&ip), 4).unwrap();
    assert_ne!(h2, h);

    // LEAVE_MCAST: the group's events read (1); the unread one of the second goes with it
    let mut n = 99u32;
    let l = abi::Destroy {
        response: ptr(&mut n),
        handle: h,
        reserved: 0,
    };
    write(&f, cmd::LEAVE_MCAST, bytemuck::bytes_of(&l), 4).unwrap();
    assert_eq!(n, 1);
    assert_eq!(
        write(&f, cmd::LEAVE_MCAST, bytemuck::bytes_of(&l), 4),
        Err(Errno::ENOENT)
    );
    let l2 = abi::Destroy {
        response: ptr(&mut n),
        handle: h2,
        reserved: 0,
    };
    assert_eq!(
        write(&file(), cmd::LEAVE_MCAST, bytemuck::bytes_of(&l2), 4),
        Err(Errno::EINVAL),
        "another file's group"
    );
    write(&f, cmd::LEAVE_MCAST, bytemuck::bytes_of(&l2), 4).unwrap();
    assert_eq!(n, 0);
    let mut ev: EventResp = bytemuck::Zeroable::zeroed();
    assert_eq!(
        write(&f, cmd::GET_EVENT, &ptr(&mut ev).to_ne_bytes(), 336),
        Err(Errno::EAGAIN),
        "the left group's event went with it"
    );
    destroy(&f, ud);
    destroy(&f, rc);
}
