//! The wire I/O thread's watch for the doorbell that answers what it delivered
//! (`softnic::sched::AnswerWatch`): a WRITE ping-pong over the wire whose two sides wait by
//! spinning on memory (as a program that polls its CQs in memory does, never giving the device
//! a turn), with the watch on and off. Either way every round's bytes and completions must be
//! exactly right (the watch only makes the device look sooner); with the watch on, the I/O
//! threads looked after the deliveries, and with it off they never did.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op, Opcode};
use prm::Completion;
use softnic::{Access, Device, DeviceConfig, WireConfig};
use std::time::{Duration, Instant};
use wire_util::*;

const ROUNDS: u64 = 300;

fn node(answer_watch: bool) -> Node {
    let dev = Device::open(DeviceConfig {
        wire: Some(WireConfig {
            answer_watch,
            ..WireConfig::loopback()
        }),
        ..Default::default()
    })
    .unwrap();
    let pd = dev.alloc_pd();
    Node { dev, pd }
}

/// Spins on offset 0 of `b` until it holds `v` (no device turn: the device's threads alone
/// must see the WRITE land).
fn spin_until(b: &Buf, v: u64) {
    let t = Instant::now();
    while b.u64_at(0) != v {
        std::hint::spin_loop();
        assert!(t.elapsed() < Duration::from_secs(20), "no WRITE of {v}");
    }
}

/// Writes `v` to the peer's buffer and waits for its completion, spinning.
fn write_and_complete(ep: &mut Ep, src: &Buf, to: prm::wqe::RemoteAddr, v: u64) {
    src.set_u64(0, v);
    let w = Op::Write {
        remote: to,
        local: Local::Sges(&[src.sge(0, 8)]),
        imm: None,
    };
    let idx = ep.post(&w, SIG);
    ep.ini.ring();
    let t = Instant::now();
    let c = loop {
        if let Some(c) = ep.ini.poll_send() {
            break c;
        }
        std::hint::spin_loop();
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no completion of {v}"
        );
    };
    match c {
        Completion::Req {
            wqe_opcode,
            wqe_counter,
            ..
        } => assert_eq!((wqe_opcode, wqe_counter), (Opcode::RdmaWrite as u8, idx)),
        c => panic!("round {v}: {c:?}"),
    }
}

/// Runs the ping-pong; returns the two devices' answer looks.
fn ping_pong(answer_watch: bool) -> (u64, u64) {
    let (a, b) = (node(answer_watch), node(answer_watch));
    link(&a, &b);
    let (mut ea, mut eb) = connect_mtu(&a, &go_back_n_opts(), &b, &go_back_n_opts(), 4096);
    let (sa, ra) = (a.buf(8, Access::LOCAL_WRITE), a.buf(8, ALL_REMOTE));
    let (sb, rb) = (b.buf(8, Access::LOCAL_WRITE), b.buf(8, ALL_REMOTE));
    let (to_b, to_a) = (rb.remote(0), ra.remote(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 1..=ROUNDS {
                spin_until(&rb, i);
                write_and_complete(&mut eb, &sb, to_a, i);
            }
        });
        for i in 1..=ROUNDS {
            write_and_complete(&mut ea, &sa, to_b, i);
            spin_until(&ra, i);
        }
    });
    for n in [&a, &b] {
        let c = n.dev.counters();
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert_eq!(c.wqes_executed, ROUNDS);
        assert_eq!(c.carry_calls, 0);
        assert!(c.answers_found <= c.answer_looks, "{c:?}");
    }
    assert!(sa.guards_intact() && ra.guards_intact() && sb.guards_intact() && rb.guards_intact());
    (a.dev.counters().answer_looks, b.dev.counters().answer_looks)
}

#[test]
fn the_io_thread_looks_for_the_answer_of_what_it_delivered() {
    let _g = serial();
    let (a, b) = ping_pong(true);
    // every WRITE that lands is a request the other side answers: its I/O thread looks
    assert!(a > 0 && b > 0, "answer looks: a {a}, b {b}");
}

#[test]
fn without_the_watch_nothing_is_lost_and_nothing_looks() {
    let _g = serial();
    assert_eq!(ping_pong(false), (0, 0));
}
