//! A companion QP (`Pd::create_companion`: a cross-channel master connected to itself) moving a
//! completion counter for another QP, driven with the CPU initiator exactly as the device API's
//! `put_counter` drives it from a kernel: a signaled WRITE on the QP, then on the companion a
//! WAIT for that WRITE's CQE number on the QP's send CQ and a fetch-add on the counter. On the
//! chosen backend: the soft NIC, or under `gpuverbs emu --devices 2` the mlx5 backend, whose
//! companion is a DEVX QP created with `cd_master` (`common`).

mod common;

use gpuverbs::post::RingMode;
use gpuverbs::queue::QpState;
use gpuverbs::{Access, ConnectOptions, CqOptions, HostBuffer, QpOptions};
use prm::wqe::{CtrlFlags, Local, Op};
use prm::{Completion, Rkey, Syndrome};
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

#[test]
fn a_companion_moves_a_counter_after_each_counted_write_and_never_for_a_failed_one() {
    let (ctx, peer) = (common::open(), common::open_peer());
    eprintln!("companion test on {}", ctx.selection().name);
    let (pd, pd_b) = (ctx.alloc_pd(), peer.alloc_pd());
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    // the QP whose WRITEs are counted, its send CQ its own (CQE number n = signaled WQE n)
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
    let cq_b = peer.create_cq(CqOptions::default()).unwrap();
    let qp_b = pd_b.create_qp(QpOptions::new(&cq_b, &cq_b)).unwrap();
    let c = ConnectOptions {
        access: rights,
        ..Default::default()
    };
    qp.connect(&qp_b.endpoint(), c).unwrap();
    qp_b.connect(&qp.endpoint(), c).unwrap();
    let cc = ctx.create_cq(CqOptions::default()).unwrap();
    let companion = pd.create_companion(None, QpOptions::new(&cc, &cc)).unwrap();
    assert_eq!(companion.state(), QpState::Rts);
    let (src, dst, ctr) = (
        HostBuffer::new(4096),
        HostBuffer::new(4096),
        HostBuffer::new(64),
    );
    src.write(0, b"counted payload!");
    let src_mr = pd.register_with(&src, rights).unwrap();
    let dst_mr = pd_b.register_with(&dst, rights).unwrap();
    let ctr_mr = pd.register_with(&ctr, rights).unwrap();
    let mut main = qp.cpu_initiator(RingMode::Doca);
    let mut comp = companion.cpu_initiator(RingMode::Doca);
    let counter = |i: &HostBuffer| u64::from_ne_bytes(i.to_vec()[..8].try_into().unwrap());
    let count = |comp: &mut gpuverbs::post::CpuInitiator, cqe: u32, res: u64| {
        let wait = Op::Wait {
            cqn: cq.cqn(),
            max_index: cqe,
        };
        let fa = Op::FetchAdd {
            remote: ctr_mr.remote(0),
            add: 1,
            result: ctr_mr.sge(res, 8),
        };
        comp.post(&wait, CtrlFlags::default()).unwrap();
        comp.post_and_ring(&fa, CtrlFlags::SIGNALED).unwrap();
    };
    for round in 0..3u64 {
        let w = Op::Write {
            remote: dst_mr.remote(64 * round),
            local: Local::Sges(&[src_mr.sge(0, 16)]),
            imm: None,
        };
        main.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
        count(&mut comp, round as u32, 8 + 8 * round);
        assert!(matches!(comp.wait_send(T).unwrap(), Completion::Req { .. }));
        // the fetch-add ran after the WRITE's CQE: the WRITE's bytes are there
        assert_eq!(counter(&ctr), round + 1);
        assert_eq!(
            &dst.to_vec()[64 * round as usize..][..16],
            b"counted payload!"
        );
        assert!(matches!(main.wait_send(T).unwrap(), Completion::Req { .. }));
    }
    // CQE 3: a WRITE into a forged rkey; the WAIT for it ends in error, the fetch-add flushes
    let mut bad = dst_mr.remote(512);
    bad.rkey = Rkey(bad.rkey.0 ^ 0x5500);
    let w = Op::Write {
        remote: bad,
        local: Local::Sges(&[src_mr.sge(0, 16)]),
        imm: None,
    };
    main.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    count(&mut comp, 3, 40);
    match main.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome(), Some(Syndrome::RemoteAccess)),
        c => panic!("{c:?}"),
    }
    match comp.wait_send(T).unwrap() {
        Completion::Error(e) => {
            assert_eq!(e.syndrome(), Some(Syndrome::WrFlush));
            assert_eq!(e.wqe_opcode, 0x0f, "the WAIT fails, not the fetch-add");
        }
        c => panic!("{c:?}"),
    }
    assert_eq!(counter(&ctr), 3, "the failed WRITE moved its counter");
    assert_eq!(companion.state(), QpState::Err);
}
