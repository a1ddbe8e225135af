//! A device carried by the program's own polling thread ([`Device::progress`]): a thread that
//! finds its CQ empty gives the device a turn (doorbells, WQEs, received datagrams) instead of
//! waiting for the device's threads, which a program polling on every core leaves no time to
//! run. What the turn does must be exactly what the engine and the wire I/O thread would have
//! done: WRITE ping-pongs over the wire, each byte and completion checked, with the pollers
//! carrying both devices while the devices' own threads still run.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op, Opcode};
use prm::Completion;
use softnic::Access;
use std::time::{Duration, Instant};
use wire_util::*;

const ROUNDS: usize = 300;

/// Polls `ep`'s send CQ, carrying `n`'s device while it is empty.
fn carried_send_cqe(n: &Node, ep: &mut Ep) -> Completion {
    let t = Instant::now();
    loop {
        if let Some(c) = ep.ini.poll_send() {
            return c;
        }
        n.dev.progress();
        assert!(t.elapsed() < Duration::from_secs(20), "no send completion");
    }
}

/// Waits for `v` at offset 0 of `b`, carrying `n`'s device meanwhile.
fn carried_until(n: &Node, b: &Buf, v: u64) {
    let t = Instant::now();
    while b.u64_at(0) != v {
        n.dev.progress();
        assert!(t.elapsed() < Duration::from_secs(20), "no WRITE of {v}");
    }
}

#[test]
fn polling_threads_carry_a_write_ping_pong_over_the_wire() {
    let _g = serial();
    let Pair {
        a,
        b,
        mut ea,
        mut eb,
    } = wire_pair(
        go_back_n_opts(),
        go_back_n_opts(),
        4096,
        Default::default(),
        Default::default(),
    );
    let (sa, ra) = (a.buf(8, Access::LOCAL_WRITE), a.buf(8, ALL_REMOTE));
    let (sb, rb) = (b.buf(8, Access::LOCAL_WRITE), b.buf(8, ALL_REMOTE));
    let (to_b, to_a) = (rb.remote(0), ra.remote(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 1..=ROUNDS as u64 {
                carried_until(&b, &rb, i);
                sb.set_u64(0, i);
                let w = Op::Write {
                    remote: to_a,
                    local: Local::Sges(&[sb.sge(0, 8)]),
                    imm: None,
                };
                let idx = eb.post(&w, SIG);
                eb.ini.ring();
                match carried_send_cqe(&b, &mut eb) {
                    Completion::Req {
                        wqe_opcode,
                        wqe_counter,
                        ..
                    } => assert_eq!((wqe_opcode, wqe_counter), (Opcode::RdmaWrite as u8, idx)),
                    c => panic!("b: round {i}: {c:?}"),
                }
            }
        });
        for i in 1..=ROUNDS as u64 {
            sa.set_u64(0, i);
            let w = Op::Write {
                remote: to_b,
                local: Local::Sges(&[sa.sge(0, 8)]),
                imm: None,
            };
            let idx = ea.post(&w, SIG);
            ea.ini.ring();
            match carried_send_cqe(&a, &mut ea) {
                Completion::Req {
                    wqe_opcode,
                    wqe_counter,
                    ..
                } => assert_eq!((wqe_opcode, wqe_counter), (Opcode::RdmaWrite as u8, idx)),
                c => panic!("a: round {i}: {c:?}"),
            }
            carried_until(&a, &ra, i);
        }
    });
    for n in [&a, &b] {
        let c = n.dev.counters();
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert_eq!(c.wqes_executed, ROUNDS as u64);
        // over hundreds of rounds the pollers did some of the work themselves
        assert!(c.carried_turns > 0, "no turn found work: {c:?}");
    }
    assert!(sa.guards_intact() && ra.guards_intact() && sb.guards_intact() && rb.guards_intact());
}

#[test]
fn a_turn_with_nothing_to_do_does_nothing() {
    let _g = serial();
    let p = wire_pair(
        go_back_n_opts(),
        go_back_n_opts(),
        4096,
        Default::default(),
        Default::default(),
    );
    let a = &p.a;
    for _ in 0..100 {
        assert!(!a.dev.progress());
    }
    assert_eq!(a.dev.counters().carried_turns, 0);
    assert_eq!(a.dev.counters().wqes_executed, 0);
}
