//! The wire's I/O thread: it receives every datagram of the device's port ([`run`]), checks it
//! (size, QP, source, ICRC, format: [`receive`]) and hands requests to the responder side
//! ([`super::responder`]) and answers to the requester side ([`super::requester`]).
//! Neither side calls the engine; the engine calls them. (The I/O thread runs the engine's
//! turn when it looks for the doorbell that answers a delivery, through the function the
//! device hands it: [`run`].)

use super::{requester, responder};
use crate::counters::{Counter, Counters};
use crate::net::packet::{self, Bth, Flow, BTH_LEN, ICRC_LEN};
use crate::net::socket::{self, Port, TxBatch};
use crate::qp::QpState;
use crate::shared::Shared;
use crate::Gid;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Takes one received datagram: checks it (size, QP, ICRC, format) and hands it to the
/// responder or requester side of its QP. Never panics on any input; every drop is counted.
pub(crate) fn receive(
    dev: &Shared,
    port: &Port,
    d: &[u8],
    (from, id_hint, run_bth): (SocketAddr, u16, &[u8]),
    dport: u16,
    scratch: &mut Vec<u8>,
    batch: &mut TxBatch,
) {
    let wc = &dev.counters.wire;
    Counters::add(&wc.rx_packets, 1);
    Counters::add(&wc.rx_bytes, d.len() as u64);
    let SocketAddr::V4(from4) = from else {
        Counters::add(&wc.rx_malformed, 1);
        return;
    };
    if d.len() < BTH_LEN + ICRC_LEN || d.len() > packet::MAX_DATAGRAM {
        port.capture_rx(
            &Flow {
                src: *from4.ip(),
                dst: port.ip,
                sport: from.port(),
                dport,
            },
            d,
            id_hint,
        );
        Counters::add(&wc.rx_malformed, 1);
        return;
    }
    let bth = Bth::from_bytes(d[..BTH_LEN].try_into().unwrap_or(&[0; BTH_LEN]));
    let qp = dev.qp(bth.dest_qp);
    let remote = qp.as_ref().and_then(|q| q.wire_remote());
    let flow = Flow {
        src: remote.map_or(*from4.ip(), |(ip, _)| ip),
        dst: port.ip,
        sport: from.port(),
        dport,
    };
    port.capture_rx(&flow, d, id_hint);
    if bth.dest_qp == crate::gsi::QPN {
        // QP1: management datagrams, for the device's GSI handler
        if !icrc_ok(port, &flow, d, id_hint, run_bth) {
            Counters::add(&wc.rx_bad_icrc, 1);
            return;
        }
        crate::gsi::on_packet(dev, d, &flow);
        return;
    }
    if let Some(q) = qp.as_ref().filter(|q| q.is_ud()) {
        // UD: datagrams from any source (no connected peer), checked as RC packets are
        if !icrc_ok(port, &flow, d, id_hint, run_bth) {
            Counters::add(&wc.rx_bad_icrc, 1);
            return;
        }
        match packet::parse(d) {
            Ok(p) if p.bth.pkey & 0x7fff == 0x7fff && packet::is_ud(p.bth.opcode) => {
                crate::ud::on_packet(dev, q, &p, &flow, d.len());
            }
            _ => Counters::add(&wc.rx_malformed, 1),
        }
        return;
    }
    if let Some(q) = qp.as_ref().filter(|q| q.dct_key().is_some()) {
        // a DC target: requests from any initiator that presents its key
        if !icrc_ok(port, &flow, d, id_hint, run_bth) {
            Counters::add(&wc.rx_bad_icrc, 1);
            return;
        }
        match packet::parse(d) {
            Ok(p) if p.bth.pkey & 0x7fff == 0x7fff && p.dceth.is_some() => {
                super::dct::on_request(dev, port, q, (&p, d), from4, (scratch, batch));
            }
            _ => Counters::add(&wc.rx_malformed, 1),
        }
        return;
    }
    let (Some(qp), Some((remote_ip, remote_qpn))) = (qp, remote) else {
        Counters::add(&wc.rx_unknown_qp, 1);
        return;
    };
    // An RC QP takes packets from its connected peer only (rxe's check_addr): the source
    // address must be the peer GID's. The source port is entropy and is not checked.
    if *from4.ip() != remote_ip {
        Counters::add(&wc.rx_wrong_source, 1);
        return;
    }
    // The IPv4 identification is covered but not visible here: any a soft NIC's segmented
    // sends produce is accepted (see `packet::icrc_ip_id`); others where a raw socket shows
    // the real one (`ip_ids`): the run's first packet's, or that plus the datagram's place in
    // the run (a sender numbering its packets).
    if !icrc_ok(port, &flow, d, id_hint, run_bth) {
        Counters::add(&wc.rx_bad_icrc, 1);
        return;
    }
    let pkt = match packet::parse(d) {
        // a UD packet names no RC QP; an RC QP takes RC packets, a DC initiator DC answers,
        // an XRC initiator XRC answers, an XRC target XRC requests
        Ok(p)
            if p.bth.pkey & 0x7fff == 0x7fff
                && p.deth.is_none()
                && p.class == qp.wire_class()
                && qp.takes_packet(packet::is_request(p.bth.opcode)) =>
        {
            p
        }
        _ => {
            Counters::add(&wc.rx_malformed, 1);
            return;
        }
    };
    let state = qp.state();
    if packet::is_request(pkt.bth.opcode) {
        if !matches!(state, QpState::Rtr | QpState::Rts) {
            Counters::add(&wc.rx_unknown_qp, 1);
            return;
        }
        // Answers go to the connected peer's address (its peer-table entry, else its GID's
        // address at the default port, as the requester's route), from the bound port; never
        // to the source of the request, which anyone may forge.
        let to = qp.answer_addr(|| match dev.peer_addr(&Gid::from_ipv4(remote_ip)) {
            Some(SocketAddr::V4(a)) => a,
            _ => std::net::SocketAddrV4::new(remote_ip, port.cfg.default_port),
        });
        let mut reply = responder::Reply {
            port,
            to: SocketAddr::V4(to),
            flow: Flow {
                src: port.ip,
                dst: flow.src,
                sport: port.local.port(),
                dport: to.port(),
            },
            dest_qp: remote_qpn,
            class: qp.wire_class(),
            buf: scratch,
            batch,
        };
        responder::on_request(dev, &qp, &pkt, d, from.port(), &mut reply);
    } else {
        requester::on_response(dev, &qp, &pkt);
    }
}

/// Whether the datagram's ICRC is right for `flow` with an IPv4 identification a sender can
/// have given it.
fn icrc_ok(port: &Port, flow: &Flow, d: &[u8], id_hint: u16, run_bth: &[u8]) -> bool {
    if packet::icrc_ip_id(flow, d, id_hint).is_some() {
        return true;
    }
    let real = port.real_ip_id(flow.src, flow.sport, flow.dport, run_bth);
    real.is_some_and(|id| {
        packet::icrc_is_for_id(flow, d, id)
            || packet::icrc_is_for_id(flow, d, id.wrapping_add(id_hint))
    })
}

// ---------------------------------------------------------------------------- I/O thread

/// The I/O thread: receives datagrams until the device shuts down. `turn` is the engine's
/// pass over the device's doorbells and WQEs ([`crate::Device::progress`]'s, passed down by
/// the device so that the wire does not call up into the engine): after delivering a datagram
/// the program may answer, the thread looks for the answer's doorbell itself
/// ([`crate::sched::AnswerWatch`]), unless the program's own polls carry the device.
pub(crate) fn run(dev: Arc<Shared>, port: Arc<Port>, turn: fn(&Shared) -> bool) {
    let mut me = crate::sched::DeviceThread::new();
    let mut fds = port.pollfds();
    let mut ready = vec![false; fds.len()];
    let mut busy = false;
    let mut spinner = crate::sched::Spinner::default();
    let mut watch = crate::sched::AnswerWatch::default();
    let mut dodge = crate::sched::CoreDodge::new();
    let mut doorbells_at_arm = 0;
    while !dev.shutdown.load(Ordering::Acquire) {
        // after traffic, look again before sleeping, unless the program's threads carry the
        // device (they receive too; a spin here would only take their core) or the core is
        // shared with a busy task (a sleeper's wake-up comes sooner: crate::sched)
        let carried = dev.carried();
        me.set_prompt(!carried);
        let now = Instant::now();
        dodge.tick(now);
        if carried {
            watch.disarm();
        } else if watch.due(now) {
            let found = look_for_answer(&dev, &mut watch, turn, doorbells_at_arm);
            if (found || !watch.armed()) && dodge.looked(found, Instant::now()) {
                tracing::debug!("wire I/O thread: moved off the core its program's poller uses");
            }
        }
        let spin =
            (busy && !carried && !watch.armed() && spinner.may_spin(now)).then_some(&mut spinner);
        let timeout = watch.wait(Instant::now(), port.recv_timeout());
        if !socket::wait_readable(&mut fds, &mut ready, spin, timeout) {
            busy = false;
            port.flush_held();
            continue;
        }
        busy = true;
        let mut rx = port.rx.lock();
        // while its stays find the answers, the ACKs of what it delivers wait for them
        rx.batch.hold_acks = port.cfg.answer_watch && !dev.carried() && watch.stays_pay();
        let mut answerable = false;
        for (i, _) in ready.iter().enumerate().filter(|(_, r)| **r) {
            match drain(&dev, &port, i, &mut rx) {
                Some((_, a)) => answerable |= a,
                None => return,
            }
        }
        drop(rx);
        if answerable && port.cfg.answer_watch && !dev.carried() {
            watch.arm(Instant::now());
            doorbells_at_arm = dev.counters.doorbells.get();
            if let Some(stay) = watch.stay() {
                let found =
                    stay_for_answer(&dev, turn, doorbells_at_arm, stay, (&mut fds, &mut ready));
                watch.stayed(found, Instant::now());
                dodge.stayed(found);
            }
        }
        // the ACKs of what it delivered waited for the stay, if any: they leave now (a stay
        // that found the answer sent them ahead of it)
        port.release_acks();
    }
}

/// The I/O thread stays, up to `stay`, for the doorbell that answers what it has just
/// delivered, running the engine's turn over and over; a datagram on one of the sockets `fds`
/// ends the stay (it is received at once). Whether the answer came (a doorbell seen since the
/// delivery).
fn stay_for_answer(
    dev: &Shared,
    turn: fn(&Shared) -> bool,
    doorbells_at_arm: u64,
    stay: std::time::Duration,
    (fds, ready): (&mut [libc::pollfd], &mut [bool]),
) -> bool {
    Counters::add(&dev.counters.answer_looks, 1);
    let until = Instant::now() + stay;
    while Instant::now() < until {
        if socket::wait_readable(fds, ready, None, std::time::Duration::ZERO) {
            return false;
        }
        turn(dev);
        if dev.counters.doorbells.get() != doorbells_at_arm {
            Counters::add(&dev.counters.answers_found, 1);
            dev.answered();
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

/// One look of the I/O thread for the doorbell that answers what it delivered: the engine's
/// turn on this thread, counted. The answer came if any doorbell was seen since the watch
/// began, by this look or by the engine (which may have got there first: the watch was
/// right all the same). Returns whether it came.
fn look_for_answer(
    dev: &Shared,
    watch: &mut crate::sched::AnswerWatch,
    turn: fn(&Shared) -> bool,
    doorbells_at_arm: u64,
) -> bool {
    Counters::add(&dev.counters.answer_looks, 1);
    turn(dev);
    let found = dev.counters.doorbells.get() != doorbells_at_arm;
    if found {
        Counters::add(&dev.counters.answers_found, 1);
        dev.answered();
    }
    if watch.looked(found, Instant::now()) && dev.answering() {
        // no answer in time (a busy machine, a slow program): the engine looks for it again
        // as often as before the watch found any
        dev.answered_at.store(0, Ordering::Relaxed);
        dev.kick();
    }
    found
}

/// Receives, on the caller's thread, what waits on the device's sockets, unless another
/// thread (the I/O thread) is receiving right now. Returns whether a datagram was taken.
///
/// A program that polls its completion queue on every core it has leaves the I/O thread no
/// time to run; this lets its polling carry the device instead.
pub(crate) fn poll_inline(dev: &Shared) -> bool {
    let Some(port) = dev.port() else {
        return false;
    };
    let Some(mut rx) = port.rx.try_lock() else {
        return false;
    };
    // a program's poll holds nothing back
    rx.batch.hold_acks = false;
    let mut got = false;
    for i in 0..port.socks.len() {
        match drain(dev, port, i, &mut rx) {
            Some((n, _)) => got |= n > 0,
            None => break,
        }
    }
    got
}

/// Receives up to one burst from socket `i` and hands each datagram to [`receive`]. Returns
/// how many datagrams were taken and whether any was one a program may answer (a SEND or
/// WRITE, a READ or atomic response, a UD datagram; not a bare ACK or NAK, nor a READ or
/// atomic request, which the device answers itself), or `None` when the device is shutting
/// down.
fn drain(dev: &Shared, port: &Port, i: usize, rx: &mut socket::RxBufs) -> Option<(usize, bool)> {
    let dport = port.sock_port(i);
    let socket::RxBufs {
        buf,
        scratch,
        batch,
    } = rx;
    let mut taken = 0;
    let mut answerable = false;
    for _ in 0..socket::RX_BURST {
        let socket::Received {
            len: n,
            from,
            seg,
            truncated,
            not_plain,
        } = match port.recv(i, buf) {
            Ok(r) => r,
            // drained (WouldBlock), or an ICMP error reported on the socket and the like: on
            // to the next socket
            Err(_) => break,
        };
        if dev.shutdown.load(Ordering::Acquire) {
            return None;
        }
        taken += 1;
        if truncated || not_plain {
            Counters::add(&dev.counters.wire.rx_packets, 1);
            let c = if truncated {
                &dev.counters.wire.rx_malformed
            } else {
                &dev.counters.wire.rx_not_plain_ip
            };
            Counters::add(c, 1);
            continue;
        }
        let data = &buf[..n];
        // the BTH's opcode, its class bits aside (a coalesced run: its first datagram's): a
        // READ or atomic request is answered by the device, never seen by the program
        answerable |= data.first().is_some_and(|op| {
            use packet::opcode::{ACK, CMP_SWAP, FETCH_ADD, READ_REQUEST};
            !matches!(op & 0x1f, ACK | READ_REQUEST | CMP_SWAP | FETCH_ADD)
        });
        match seg {
            Some(s) if s > 0 && n > s => {
                // a run's n-th datagram was most likely a segmented send's n-th segment: its
                // identification (the ICRC's hint)
                let run_bth = &data[..BTH_LEN.min(data.len())];
                for (k, d) in data.chunks(s).enumerate() {
                    receive(
                        dev,
                        port,
                        d,
                        (from, k as u16, run_bth),
                        dport,
                        scratch,
                        batch,
                    );
                }
            }
            _ => receive(
                dev,
                port,
                data,
                (from, 0, &data[..BTH_LEN.min(data.len())]),
                dport,
                scratch,
                batch,
            ),
        }
        port.flush_or_hold(batch);
    }
    Some((taken, answerable))
}
