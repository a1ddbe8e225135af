//! The software-emulated no-DBR mode (`DoorbellMode::NoDbrEmulated`, DOCA GPUNetIO's
//! `SEND_DBR_MODE_EXT_NO_DBR_SW_EMULATED` for a ConnectX-7 or older): an ordinary QP, with a
//! doorbell record, that the producer rings at its ordinary register without ever writing the
//! record, publishing its producer index in the CPU-proxy word; a host proxy thread stores the
//! record from the word, fences and rings again. On the chosen backend: the soft NIC, or under
//! `gpuverbs emu --devices 2` the mlx5 backend (an ordinary provider or DEVX QP: no
//! `send_dbr_mode`), where the data test needs the soft NIC's raw view and its fault
//! injection and says it is skipped (`common`).

mod common;

use gpuverbs::post::BF_OFFSET;
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::queue::QpState;
use gpuverbs::{ConnectOptions, CqOptions, DoorbellMode, QpOptions};
use prm::wqe::{CtrlFlags, Local, Op};
use prm::Completion;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use verbs::initiator::Initiator;

const T: Duration = Duration::from_secs(10);

fn emulated(cq: &gpuverbs::Cq) -> QpOptions {
    QpOptions {
        doorbell: DoorbellMode::NoDbrEmulated,
        ..QpOptions::new(cq, cq)
    }
}

#[test]
fn an_emulated_no_dbr_qp_is_an_ordinary_qp_that_the_proxy_serves() {
    let (ctx, peer) = (common::open(), common::open_peer());
    eprintln!("emulated no-DBR test on {}", ctx.selection().name);
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    // an ordinary QP on every backend (the provider's too: nothing to ask of the device)
    let qp = pd.create_qp(emulated(&cq)).unwrap();
    assert_eq!(
        qp.doorbell(),
        (DoorbellMode::NoDbrEmulated, "requested"),
        "{:?}",
        qp.doorbell()
    );
    assert!(qp.doorbell().0.proxied());
    if let Some(s) = qp.soft() {
        // the ordinary register, not the DBR-less one of DoorbellMode::NoDbr
        assert_eq!(s.bf_offset(), BF_OFFSET);
        assert_eq!(s.doorbell_mode(), DoorbellMode::NoDbrEmulated);
    }
    // the CPU proxy keeps its record: a target is made (a no-DBR QP's is refused)
    let target = ProxyTarget::for_qp(&qp).unwrap();
    assert_eq!(target.qpn(), qp.qpn());
    assert_eq!(target.start(), 0);
    drop(target);
    let pd_b = peer.alloc_pd();
    let cq_b = peer.create_cq(CqOptions::default()).unwrap();
    let qp_b = pd_b.create_qp(QpOptions::new(&cq_b, &cq_b)).unwrap();
    qp.connect(&qp_b.endpoint(), ConnectOptions::default())
        .unwrap();
    qp_b.connect(&qp.endpoint(), ConnectOptions::default())
        .unwrap();
    assert_eq!(qp.state(), QpState::Rts);
}

/// The QP's send record word, as a number.
fn send_record(s: &gpuverbs::soft::raw::Qp) -> u32 {
    let mut rec = [0u8; 8];
    s.dbrec_page().read(s.dbrec_offset(), &mut rec);
    u32::from_be_bytes([rec[4], rec[5], rec[6], rec[7]])
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Soft NIC: a doorbell the device drops is lost for good while nobody keeps the record (the
/// WRITE does not run); once the proxy serves the QP it stores the record from the producer
/// word and rings again, and the WRITE runs. Then three more WRITEs, rung by the player and
/// re-rung by the proxy: each lands, the player never wrote the QP's record (its send word
/// went to the decoy) and the proxy's record follows the producer. `remove` returns the last
/// producer it forwarded, before the QP goes.
#[test]
fn the_proxy_keeps_the_record_and_recovers_a_dropped_doorbell() {
    let ctx = common::open();
    if common::skipped_on_mlx5(
        &ctx,
        "emulated no-DBR data",
        "needs the soft NIC's raw rings and a dropped doorbell (fault injection)",
    ) {
        return;
    }
    let peer = common::open_peer();
    let common::WritePair {
        qp,
        qp_b: _qp_b,
        src: _src,
        dst,
        src_mr,
        dst_mr,
    } = common::write_pair(&ctx, &peer, emulated, b"emulated no DBR!");
    let s = qp.soft().unwrap().clone();
    let decoy = Arc::new(verbs::DmaBuf::alloc(64));
    let mut ini = common::decoy_player(&s, &decoy);
    let target = ProxyTarget::for_qp(&qp).unwrap();
    // the word the kernel publishes into (live while the QP is: the target keeps it)
    let word: *const AtomicU64 = target.producer_word();
    let publish = |ini: &Initiator| {
        // SAFETY: the QP's proxy word, kept alive by `target` (then by the service).
        unsafe { &*word }.store(u64::from(ini.producer()), Ordering::Release);
    };
    let sge = [src_mr.sge(0, 16)];
    let write = |round: u64| Op::Write {
        remote: dst_mr.remote(64 * round),
        local: Local::Sges(&sge),
        imm: None,
    };
    let register = || s.uar().atomic_u64(s.bf_offset()).load(Ordering::Acquire);

    // 1. the device drops the player's doorbell; nobody keeps the record yet
    s.inject(gpuverbs::soft::Fault::DropDoorbells(1));
    ini.post_and_ring(&write(0), CtrlFlags::SIGNALED).unwrap();
    publish(&ini);
    // the engine read it (and took it out of the register) and dropped it
    wait_for("the engine to take the doorbell", || register() == 0);
    std::thread::sleep(Duration::from_millis(50));
    assert!(ini.poll_send().is_none(), "a dropped doorbell's WRITE ran");
    assert_eq!(&dst.to_vec()[..16], &[0u8; 16]);
    assert_eq!(send_record(&s), 0, "the player wrote the record");

    // 2. the proxy serves the QP: record from the word, fence, the doorbell again
    let svc = ProxyService::start(ProxyConfig::default()).unwrap();
    let handle = svc.add(target).unwrap();
    assert!(matches!(ini.wait_send(T).unwrap(), Completion::Req { .. }));
    assert_eq!(&dst.to_vec()[..16], b"emulated no DBR!");
    assert_eq!(send_record(&s), 1);

    // 3. more WRITEs, rung by the player and again by the proxy
    for round in 1..4u64 {
        ini.post_and_ring(&write(round), CtrlFlags::SIGNALED)
            .unwrap();
        publish(&ini);
        assert!(matches!(ini.wait_send(T).unwrap(), Completion::Req { .. }));
        let at = 64 * round as usize;
        assert_eq!(&dst.to_vec()[at..at + 16], b"emulated no DBR!");
        wait_for("the proxy's record", || {
            send_record(&s) == u32::from(ini.producer())
        });
    }
    assert_eq!(svc.counters().bad_producers, 0);
    assert!(svc.counters().doorbells >= 4, "{:?}", svc.counters());
    // SAFETY: the decoy's live 64 bytes, 4-byte aligned.
    let sent = unsafe { std::ptr::read_volatile(decoy.as_ptr().cast::<u32>().add(1)) };
    assert_eq!(
        u32::from_be(sent),
        4,
        "the decoy took the player's send words"
    );
    // the proxy lets the QP go before it is destroyed
    assert_eq!(svc.remove(handle).unwrap(), 4);
    drop(svc);
    drop(ini);
}
