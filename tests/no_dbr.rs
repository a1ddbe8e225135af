//! QPs without a send doorbell record (`DoorbellMode::NoDbr`, a ConnectX-8's `send_dbr_mode`
//! NO_DBR_EXT, DOCA GPUNetIO's `NIC_HANDLER_GPU_SM_NO_DBR`). On the chosen backend: the soft
//! NIC, or under `gpuverbs emu --devices 2` the mlx5 backend, whose DEVX QPs
//! (`GPUVERBS_MLX5_DEVX=1`) are made with `send_dbr_mode` 1 and whose provider QPs refuse the
//! mode (`common`).

mod common;

use gpuverbs::post::RingMode;
use gpuverbs::queue::QpState;
use gpuverbs::{ConnectOptions, CqOptions, DoorbellMode, Error, QpOptions};
use prm::doorbell::DBR_LESS_OFFSET;
use prm::wqe::{CtrlFlags, Local, Op};
use prm::Completion;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn no_dbr(cq: &gpuverbs::Cq) -> QpOptions {
    QpOptions {
        doorbell: DoorbellMode::NoDbr,
        ..QpOptions::new(cq, cq)
    }
}

/// The mlx5 backend makes a QP on host rings and provider CQs with the provider, unless
/// GPUVERBS_MLX5_DEVX is set.
fn provider_qps(ctx: &gpuverbs::Context) -> bool {
    common::is_mlx5(ctx) && std::env::var_os("GPUVERBS_MLX5_DEVX").is_none_or(|v| v != "1")
}

#[test]
fn a_no_dbr_qp_is_made_and_reported_or_refused_by_the_provider() {
    let (ctx, peer) = (common::open(), common::open_peer());
    eprintln!("no-DBR test on {}", ctx.selection().name);
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let made = pd.create_qp(no_dbr(&cq));
    if provider_qps(&ctx) {
        // rdma-core's verbs path has no send_dbr_mode: a clear refusal, never a QP with a DBR
        match made {
            Err(Error::Unsupported(m)) => assert!(m.contains("NoDbr"), "{m}"),
            other => panic!("a provider no-DBR QP: {other:?}"),
        }
        return;
    }
    let qp = made.unwrap();
    assert_eq!(qp.doorbell().0, DoorbellMode::NoDbr);
    assert_eq!(qp.doorbell().1, "requested");
    if let Some(s) = qp.soft() {
        assert_eq!(s.bf_offset(), DBR_LESS_OFFSET);
        assert_eq!(s.doorbell_mode(), DoorbellMode::NoDbr);
    }
    // the CPU initiator writes the send doorbell record: refused on such a QP
    match qp.try_cpu_initiator(RingMode::Doca) {
        Err(Error::Unsupported(m)) => assert!(m.contains("doorbell record"), "{m}"),
        Err(e) => panic!("the CPU initiator on a no-DBR QP: {e}"),
        Ok(_) => panic!("the CPU initiator on a no-DBR QP was made"),
    }
    // so does the CPU proxy (it writes the record too)
    match gpuverbs::proxy::ProxyTarget::for_qp(&qp) {
        Err(Error::Unsupported(m)) => assert!(m.contains("doorbell record"), "{m}"),
        Err(e) => panic!("a CPU-proxy target of a no-DBR QP: {e}"),
        Ok(_) => panic!("a CPU-proxy target of a no-DBR QP was made"),
    }
    // it connects as any QP
    let pd_b = peer.alloc_pd();
    let cq_b = peer.create_cq(CqOptions::default()).unwrap();
    let qp_b = pd_b.create_qp(QpOptions::new(&cq_b, &cq_b)).unwrap();
    qp.connect(&qp_b.endpoint(), ConnectOptions::default())
        .unwrap();
    qp_b.connect(&qp.endpoint(), ConnectOptions::default())
        .unwrap();
    assert_eq!(qp.state(), QpState::Rts);
}

/// Soft NIC: WRITEs posted into a no-DBR QP's own SQ ring and rung only at its DBR-less
/// register (UAR + 0x600, the doorbell value carrying the producer index, as a kernel rings it)
/// move their bytes, and the QP's doorbell record stays 0. The SQ's send word goes to a decoy
/// record, so the one the device has is never written.
#[test]
fn a_soft_no_dbr_qp_moves_data_with_its_record_never_written() {
    let ctx = common::open();
    if common::skipped_on_mlx5(
        &ctx,
        "no-DBR data",
        "its rings are the provider's (no raw view)",
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
    } = common::write_pair(&ctx, &peer, no_dbr, b"no doorbell rec!");
    let s = qp.soft().unwrap().clone();
    let record = s.dbrec_page().as_ptr().wrapping_add(s.dbrec_offset());
    let decoy = Arc::new(verbs::DmaBuf::alloc(64));
    let mut ini = common::decoy_player(&s, &decoy);
    let word = |i: usize| {
        // SAFETY: the QP's live 8-byte doorbell record, 4-byte aligned words.
        unsafe { std::ptr::read_volatile(record.cast::<u32>().add(i)) }
    };
    for round in 0..3usize {
        let w = Op::Write {
            remote: dst_mr.remote(64 * round as u64),
            local: Local::Sges(&[src_mr.sge(0, 16)]),
            imm: None,
        };
        ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
        assert!(matches!(ini.wait_send(T).unwrap(), Completion::Req { .. }));
        assert_eq!(&dst.to_vec()[64 * round..][..16], b"no doorbell rec!");
        assert_eq!(word(1), 0, "the send doorbell record was written");
    }
    // SAFETY: the decoy's live 64 bytes, 4-byte aligned.
    let sent = unsafe { std::ptr::read_volatile(decoy.as_ptr().cast::<u32>().add(1)) };
    assert_eq!(u32::from_be(sent), 3, "the decoy took the send word");
}
