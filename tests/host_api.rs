//! The host API end to end with the CPU initiator, on the chosen backend (the soft NIC, or
//! under `gpuverbs emu` the mlx5 backend on `mlx5_0`/`mlx5_1`: `common`): device selection,
//! memory, queues, connection, every operation, the errors of bad input, and every error class
//! of the completions (bad rkey, bad lkey, length, QP state, RNR, retry exhaustion), which
//! must be the same completions on both backends.

mod common;

use gpuverbs::post::RingMode;
use gpuverbs::queue::{CqMode, QpState};
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DeviceRequest, DoorbellMode, Error, HostBuffer,
    QpOptions, RingPlacement,
};
use prm::wqe::{AtomicSize, CtrlFlags, Local, Op};
use prm::{Completion, Syndrome};
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

struct Side {
    ctx: Context,
    pd: gpuverbs::Pd,
    qp: gpuverbs::Qp,
    buf: HostBuffer,
    mr: gpuverbs::Mr,
}

fn side(ctx: Context, mode: DoorbellMode) -> Side {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let mut o = QpOptions::new(&cq, &cq);
    o.doorbell = mode;
    let qp = pd.create_qp(o).unwrap();
    let buf = HostBuffer::new(8192);
    let mr = pd
        .register_with(
            &buf,
            Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
        )
        .unwrap();
    Side {
        ctx,
        pd,
        qp,
        buf,
        mr,
    }
}

fn all_rights() -> ConnectOptions {
    ConnectOptions {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        ..Default::default()
    }
}

/// A QP on the chosen device connected to one on the peer device.
fn connected(mode: DoorbellMode) -> (Side, Side) {
    connected_with(mode, all_rights())
}

fn connected_with(mode: DoorbellMode, o: ConnectOptions) -> (Side, Side) {
    let (a, b) = (
        side(common::open(), mode),
        side(common::open_peer(), DoorbellMode::Auto),
    );
    a.qp.connect(&b.qp.endpoint(), o).unwrap();
    b.qp.connect(&a.qp.endpoint(), o).unwrap();
    (a, b)
}

fn ok(c: Completion) {
    assert!(matches!(c, Completion::Req { .. }), "{c:?}");
}

#[test]
fn selection_is_reported_and_env_overrides() {
    let ctx = Context::open(DeviceRequest::Auto).unwrap();
    let s = ctx.selection();
    assert!(!s.reason.is_empty(), "a selection always says why");
    if common::is_mlx5(&ctx) {
        // an rdma-core device: its name, and the GID and MTU the backend picked
        assert!(s.name.starts_with("mlx5"), "{s}");
        assert!(
            s.reason.contains("GID index") && s.reason.contains("MTU"),
            "{s}"
        );
        let again = Context::open(DeviceRequest::Named(s.name.clone())).unwrap();
        assert_eq!(again.selection().kind, s.kind);
        assert!(
            again.selection().reason.contains("requested in code"),
            "{s}"
        );
    } else {
        assert!(s.name.starts_with("softnic"), "{s}");
    }
    let named = Context::open(DeviceRequest::Named("softnic-test-x".into())).unwrap();
    assert_eq!(named.selection().name, "softnic-test-x");
    match Context::open(DeviceRequest::Named("mlx5_9".into())) {
        Err(Error::NoSuchDevice(n)) => assert_eq!(n, "mlx5_9"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn every_operation_through_the_public_api() {
    for ring in [RingMode::RdmaCore, RingMode::Doca, RingMode::BlueFlame] {
        let mode = if ring == RingMode::BlueFlame {
            DoorbellMode::BlueFlame
        } else {
            DoorbellMode::GpuDoorbell
        };
        let (a, b) = connected(mode);
        assert_eq!(a.qp.doorbell().0, mode);
        let mut ini = a.qp.cpu_initiator(ring);
        let mut resp = b.qp.cpu_initiator(RingMode::Doca);
        a.buf.write(0, &[5u8; 64]);
        // write
        let w = Op::Write {
            remote: b.mr.remote(0),
            local: Local::Sges(&[a.mr.sge(0, 64)]),
            imm: None,
        };
        ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
        ok(ini.wait_send(T).unwrap());
        assert_eq!(b.buf.to_vec()[..64], [5u8; 64]);
        // inline write
        let w = Op::Write {
            remote: b.mr.remote(100),
            local: Local::Inline(b"inline!"),
            imm: None,
        };
        ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
        ok(ini.wait_send(T).unwrap());
        assert_eq!(&b.buf.to_vec()[100..107], b"inline!");
        // send with immediate into a posted receive
        resp.post_recv(&[b.mr.sge(1000, 64)]).unwrap();
        let s = Op::Send {
            local: Local::Sges(&[a.mr.sge(0, 16)]),
            imm: Some(77),
        };
        ini.post_and_ring(&s, CtrlFlags::SIGNALED).unwrap();
        ok(ini.wait_send(T).unwrap());
        match resp.wait_recv(T).unwrap() {
            Completion::Resp {
                byte_cnt: 16,
                imm: Some(77),
                ..
            } => {}
            c => panic!("{c:?}"),
        }
        // read
        b.buf.write(2000, b"read me");
        let r = Op::Read {
            remote: b.mr.remote(2000),
            local: &[a.mr.sge(3000, 7)],
        };
        ini.post_and_ring(&r, CtrlFlags::SIGNALED).unwrap();
        ok(ini.wait_send(T).unwrap());
        assert_eq!(&a.buf.to_vec()[3000..3007], b"read me");
        // atomics
        b.buf.write(4096, &40u64.to_ne_bytes());
        let fa = Op::FetchAdd {
            remote: b.mr.remote(4096),
            add: 2,
            result: a.mr.sge(4096, 8),
        };
        ini.post_and_ring(&fa, CtrlFlags::SIGNALED).unwrap();
        ok(ini.wait_send(T).unwrap());
        let cs = Op::CompareSwap {
            remote: b.mr.remote(4096),
            compare: 42,
            swap: 7,
            result: a.mr.sge(4104, 8),
        };
        ini.post_and_ring(&cs, CtrlFlags::SIGNALED).unwrap();
        ok(ini.wait_send(T).unwrap());
        let m = Op::MaskedFetchAdd {
            size: AtomicSize::B8,
            remote: b.mr.remote(4096),
            add: 1,
            field_boundary: 0,
            result: a.mr.sge(4112, 8),
        };
        ini.post_and_ring(&m, CtrlFlags::SIGNALED).unwrap();
        ok(ini.wait_send(T).unwrap());
        let v = a.buf.to_vec();
        let word = |o: usize| u64::from_ne_bytes(v[o..o + 8].try_into().unwrap());
        assert_eq!((word(4096), word(4104), word(4112)), (40, 42, 7));
        assert_eq!(
            u64::from_ne_bytes(b.buf.to_vec()[4096..4104].try_into().unwrap()),
            8
        );
    }
}

#[test]
fn automatic_ring_placement_without_a_gpu_is_host_memory_and_says_why() {
    // (with a GPU, a ConnectX takes GPU rings and the soft NIC host rings: gpu-test's
    // put_autorings_* cases on both backends)
    let ctx = common::open();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
    for (placement, why) in [
        (cq.placement(), cq.placement_reason()),
        (qp.placement(), qp.placement_reason()),
    ] {
        assert_eq!(placement, RingPlacement::HostMapped, "{why}");
        assert!(why.starts_with("auto: host memory, no GPU given"), "{why}");
    }
    // host rings: the CPU initiator can drive them
    assert!(qp.try_cpu_initiator(RingMode::Doca).is_ok());
}

#[test]
fn bad_inputs_are_errors() {
    let ctx = common::open();
    let mlx5 = common::is_mlx5(&ctx);
    let pd = ctx.alloc_pd();
    assert!(matches!(
        ctx.create_cq(CqOptions {
            depth: 100,
            ..Default::default()
        }),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ctx.create_cq(CqOptions {
            placement: RingPlacement::Gpu,
            ..Default::default()
        }),
        Err(Error::Unsupported(_))
    ));
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let mut o = QpOptions::new(&cq, &cq);
    o.sq_blocks = 100;
    match pd.create_qp(o) {
        Err(Error::Soft(_)) if !mlx5 => {}
        Err(Error::InvalidArgument(m)) if mlx5 => assert!(m.contains("powers of two"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        pd.register_gpu(0x1000, 4096, Access::LOCAL_WRITE),
        Err(Error::Unsupported(_))
    ));
    // remote rights without local write are refused, as in verbs
    let buf = HostBuffer::new(64);
    match pd.register_with(&buf, Access::REMOTE_WRITE) {
        Err(Error::Soft(_)) if !mlx5 => {}
        // the kernel's check (ib_check_mr_access): EINVAL
        Err(Error::Verbs {
            call: "ibv_reg_mr",
            errno,
            ..
        }) if mlx5 => assert_eq!(errno, 22),
        other => panic!("{other:?}"),
    }
    // access defaults to local only: a peer cannot write through it
    let mr = pd.register(&buf).unwrap();
    assert_eq!(mr.access(), Access::LOCAL_WRITE);
    // illegal transitions
    let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    let rts = gpuverbs::Modify::Rts(gpuverbs::soft::raw::RtsAttr::default());
    match qp.modify(rts) {
        Err(Error::Soft(gpuverbs::soft::Error::IllegalTransition { .. })) if !mlx5 => {}
        // rdma-core transitions that take attributes go through Qp::connect
        Err(Error::Unsupported(m)) if mlx5 => assert!(m.contains("Qp::connect"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(qp.state(), QpState::Reset);
    // export needs CUDA: without a driver it is an error, not a panic
    if !gpuverbs::cuda::driver_available() {
        assert!(gpuverbs::gpu::Gpu::open(0).is_err());
    }
}

#[test]
fn default_access_refuses_remote_writes() {
    let (a, b) = connected(DoorbellMode::GpuDoorbell);
    let local_only = b.pd.register(&HostBuffer::new(64)).unwrap();
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let w = Op::Write {
        remote: local_only.remote(0),
        local: Local::Sges(&[a.mr.sge(0, 8)]),
        imm: None,
    };
    ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    match ini.wait_send(T).unwrap() {
        Completion::Error(e) => assert_eq!(e.syndrome(), Some(Syndrome::RemoteAccess)),
        c => panic!("{c:?}"),
    }
    assert_eq!(a.qp.state(), QpState::Err);
    drop(b.ctx);
}

/// A QP whose CQ has 4 entries, connected to a peer, and its CPU initiator.
fn small_cq_pair(mode: CqMode) -> Result<(Side, Side, gpuverbs::post::CpuInitiator), Error> {
    let ctx = common::open();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions {
        depth: 4,
        mode,
        ..Default::default()
    })?;
    assert_eq!(cq.depth(), 4);
    let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
    let buf = HostBuffer::new(4096);
    let mr = pd.register_with(&buf, Access::LOCAL_WRITE).unwrap();
    let a = Side {
        ctx,
        pd,
        qp,
        buf,
        mr,
    };
    let b = side(common::open_peer(), DoorbellMode::Auto);
    a.qp.connect(&b.qp.endpoint(), all_rights()).unwrap();
    b.qp.connect(&a.qp.endpoint(), all_rights()).unwrap();
    let ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    Ok((a, b, ini))
}

/// 16 signaled WRITEs into the 4-entry CQ, which nobody polls meanwhile.
fn flood(a: &Side, b: &Side, ini: &mut gpuverbs::post::CpuInitiator) {
    for i in 0..16u64 {
        let op = Op::Write {
            remote: b.mr.remote(i * 8),
            local: Local::Sges(&[a.mr.sge(i * 8, 8)]),
            imm: None,
        };
        ini.post(&op, CtrlFlags::SIGNALED).unwrap();
    }
    ini.ring();
}

#[test]
fn the_default_cq_reports_an_overrun_to_the_poller() {
    let (a, b, mut ini) = small_cq_pair(CqMode::OverrunDetect).unwrap();
    flood(&a, &b, &mut ini);
    // On both backends the 5th CQE finds the CQ full: the CQ goes to error, the QP to ERR.
    let deadline = std::time::Instant::now() + T;
    while a.qp.state() != QpState::Err {
        assert!(std::time::Instant::now() < deadline, "no overrun detected");
        std::thread::yield_now();
    }
    for i in 0..4 {
        assert!(
            matches!(ini.wait_send(T).unwrap(), Completion::Req { wqe_counter, .. } if wqe_counter == i)
        );
    }
    // Nothing was written past them: the CQ in error takes no CQE, not even the flushes.
    assert_eq!(ini.poll_send(), None);
    if common::skipped_on_mlx5(
        &a.ctx,
        "the_default_cq_reports_an_overrun_to_the_poller",
        "InitiatorError::CqOverrun and the overrun counters: the CPU initiator learns of an \
         overrun from the soft CQ (an rdma-core CQ reports it as an async CQ_ERR event, which \
         the backend does not read)",
    ) {
        return;
    }
    assert_eq!(
        ini.wait_send(T),
        Err(gpuverbs::post::InitiatorError::CqOverrun("send"))
    );
    assert!(ini.cq_overrun(false));
    assert!(a.qp.send_cq().soft().unwrap().is_overrun());
    // the 5th CQE and the 11 flushes after it (the engine may still be flushing: wait for them)
    let overruns = || a.ctx.soft_device().unwrap().counters().cq_overruns;
    let deadline = std::time::Instant::now() + T;
    while overruns() < 12 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(overruns(), 12);
}

#[test]
fn overrun_ignore_stays_available_on_request() {
    // (on the mlx5 backend an overrun-ignore CQ is a DEVX object: the provider's CQs detect)
    let (a, b, mut ini) = small_cq_pair(CqMode::OverrunIgnore).unwrap();
    flood(&a, &b, &mut ini);
    let soft = a.ctx.soft_device();
    let deadline = std::time::Instant::now() + T;
    while b.buf.to_vec()[120..128] != a.buf.to_vec()[120..128]
        || soft.is_some_and(|d| d.counters().wqes_executed < 16)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the WRITEs did not run"
        );
        std::thread::yield_now();
    }
    assert_eq!(a.qp.state(), QpState::Rts);
    assert!(!ini.cq_overrun(false));
    if let Some(d) = soft {
        assert_eq!(d.counters().cq_overruns, 0);
    }
    // the ring was overwritten: what is there is whatever the last lap left, never an error
    while let Some(c) = ini.poll_send() {
        assert!(matches!(c, Completion::Req { .. }), "{c:?}");
    }
}

#[test]
fn host_buffer_len_is_what_was_asked() {
    for len in [0usize, 1, 16, 4095, 4096, 4097, 10_000] {
        let b = HostBuffer::new(len);
        assert_eq!(b.len(), len);
        assert_eq!(b.is_empty(), len == 0);
        assert_eq!(b.to_vec(), vec![0u8; len]);
        assert_eq!(b.addr() % 4096, 0, "page-aligned");
    }
    let b = HostBuffer::new(16);
    b.write(8, &[7; 8]);
    assert_eq!(b.to_vec(), [[0u8; 8], [7; 8]].concat());
    // a region covers what was asked for
    let ctx = common::open();
    let mr = ctx.alloc_pd().register(&b).unwrap();
    assert_eq!(mr.len(), 16);
}

#[test]
fn host_buffer_sizes_the_allocator_cannot_serve_are_errors() {
    for len in [usize::MAX - 10, usize::MAX, isize::MAX as usize - 10] {
        match HostBuffer::try_new(len) {
            Err(Error::HostAlloc { len: l, .. }) => assert_eq!(l, len),
            Err(e) => panic!("{len}: {e}"),
            Ok(b) => panic!("{len}: a buffer of {} bytes", b.len()),
        }
    }
    // More than this machine has: refused by the allocator where the kernel does not
    // overcommit without limit (mode 1 would hand out the address space).
    let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    if mode.trim() != "1" {
        assert!(matches!(
            HostBuffer::try_new(1 << 50),
            Err(Error::HostAlloc { .. })
        ));
    }
}

#[test]
#[should_panic(expected = "HostBuffer::new(18446744073709551605): cannot allocate")]
fn host_buffer_new_panics_clearly_when_it_cannot_allocate() {
    let _ = HostBuffer::new(usize::MAX - 10);
}

#[test]
#[should_panic(expected = "HostBuffer::write: 12+8 is beyond its 16 bytes")]
fn host_buffer_access_is_bounded_by_its_length() {
    HostBuffer::new(16).write(12, &[0; 8]);
}

#[test]
fn dump_reads_one_local_segment_and_completes() {
    // DUMP (0x23) needs no peer: a QP in RTS towards nothing in particular will do.
    let (a, _b) = connected(DoorbellMode::Auto);
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let idx = ini
        .post_and_ring(
            &Op::Dump {
                local: a.mr.sge(64, 256),
            },
            CtrlFlags::SIGNALED,
        )
        .unwrap();
    match ini.wait_send(T).unwrap() {
        Completion::Req {
            wqe_opcode,
            byte_cnt,
            wqe_counter,
            ..
        } => assert_eq!((wqe_opcode, byte_cnt, wqe_counter), (0x23, 256, idx)),
        c => panic!("{c:?}"),
    }
    // a bad lkey is the requester's LOCAL_PROT, as for any local segment
    let mut bad = a.mr.sge(0, 8);
    bad.lkey = prm::Lkey(bad.lkey.0 ^ 0x5500);
    ini.post_and_ring(&Op::Dump { local: bad }, CtrlFlags::SIGNALED)
        .unwrap();
    match ini.wait_send(T).unwrap() {
        Completion::Error(e) => {
            assert_eq!(e.syndrome(), Some(Syndrome::LocalProt));
            assert_eq!(e.wqe_opcode, 0x23);
        }
        c => panic!("{c:?}"),
    }
    assert_eq!(a.qp.state(), QpState::Err);
}

#[test]
fn wait_completes_once_the_cq_has_written_cqe_number_max_index() {
    // WAIT { cqn, max_index } waits for CQE number max_index (from 0) of the CQ to be written.
    // The waiter is a companion (Pd::create_companion: a cross-channel master connected to
    // itself); on the mlx5 backend a DEVX QP with cd_master.
    let (a, b) = connected(DoorbellMode::Auto);
    let cw = a.ctx.create_cq(CqOptions::default()).unwrap();
    let w =
        a.pd.create_companion(None, QpOptions::new(&cw, &cw))
            .unwrap();
    let c2 = a.ctx.create_cq(CqOptions::default()).unwrap();
    let q2 = a.pd.create_qp(QpOptions::new(&c2, &c2)).unwrap();
    let cb = b.ctx.create_cq(CqOptions::default()).unwrap();
    let qb = b.pd.create_qp(QpOptions::new(&cb, &cb)).unwrap();
    q2.connect(&qb.endpoint(), ConnectOptions::default())
        .unwrap();
    qb.connect(&q2.endpoint(), ConnectOptions::default())
        .unwrap();
    let mut waiter = w.cpu_initiator(RingMode::Doca);
    let mut other = q2.cpu_initiator(RingMode::Doca);
    // CQE number 1: the second
    let wait = Op::Wait {
        cqn: c2.cqn(),
        max_index: 1,
    };
    waiter.post_and_ring(&wait, CtrlFlags::SIGNALED).unwrap();
    let short = Duration::from_millis(50);
    for n in 1..=2u32 {
        // one edge: with CQEs 0 .. max_index - 1 written, the WAIT has not completed
        assert!(
            waiter.wait_send(short).is_err(),
            "completed at {} CQEs",
            n - 1
        );
        other.post_and_ring(&Op::Nop, CtrlFlags::SIGNALED).unwrap();
        ok(other.wait_send(T).unwrap());
        if let Some(soft) = c2.soft() {
            assert_eq!(soft.produced(), n);
        }
    }
    // the other edge: once CQE number max_index is written it completes
    match waiter.wait_send(T).unwrap() {
        Completion::Req { wqe_opcode, .. } => assert_eq!(wqe_opcode, 0x0f),
        c => panic!("{c:?}"),
    }
    // a max_index already passed completes at once
    waiter
        .post_and_ring(
            &Op::Wait {
                cqn: c2.cqn(),
                max_index: 0,
            },
            CtrlFlags::SIGNALED,
        )
        .unwrap();
    ok(waiter.wait_send(T).unwrap());
    // a QP that is not a cross-channel master cannot WAIT: LOCAL_QP_OP, the QP in ERR
    drop(other);
    let mut plain = q2.cpu_initiator(RingMode::Doca);
    plain.post_and_ring(&wait, CtrlFlags::SIGNALED).unwrap();
    match plain.wait_send(T).unwrap() {
        Completion::Error(e) => {
            assert_eq!(e.syndrome(), Some(Syndrome::LocalQpOp));
            assert_eq!(e.wqe_opcode, 0x0f);
        }
        c => panic!("{c:?}"),
    }
    assert_eq!(q2.state(), QpState::Err);
}

#[test]
fn deregister_and_the_registration_cache_on_the_chosen_backend() {
    // The soft NIC here; under `gpuverbs emu` the mlx5 backend, whose SQ progress the host
    // cannot watch: `Mr::deregister` reports its live QPs at once instead of waiting.
    let ctx = common::open();
    let mlx5 = common::is_mlx5(&ctx);
    assert_eq!(mlx5, ctx.soft_device().is_none());
    let pd = ctx.alloc_pd();
    let buf = HostBuffer::new(4096);
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    // No QP on the PD: nothing in flight, on either backend.
    let mr = pd.register_with(&buf, rights).unwrap();
    let generation = mr.generation();
    mr.deregister(Duration::ZERO).unwrap();
    // Host memory goes through the cache on both backends.
    let cold = pd.register_cached(&buf, rights).unwrap();
    let warm = pd.register_cached(&buf, rights).unwrap();
    assert_eq!((cold.lkey(), cold.rkey()), (warm.lkey(), warm.rkey()));
    assert_ne!(cold.generation(), generation);
    let st = pd.reg_cache().stats();
    assert_eq!((st.hits, st.misses, st.entries), (1, 1, 1));
    drop((cold, warm));
    // A QP connected (to itself) and idle.
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
    let o = ConnectOptions {
        access: Access::REMOTE_WRITE,
        ..Default::default()
    };
    qp.connect(&qp.endpoint(), o).unwrap();
    let mr = pd.register_with(&buf, rights).unwrap();
    match mr.deregister(Duration::ZERO) {
        Ok(()) => assert!(!mlx5, "mlx5 cannot tell an idle QP from a busy one"),
        Err(e) => {
            assert!(mlx5, "the soft NIC sees the QP idle: {e}");
            let r = e.report();
            assert_eq!(r.qps.len(), 1, "{e}");
            assert_eq!((r.qps[0].qpn, r.qps[0].blocks), (qp.qpn(), None), "{e}");
            assert_eq!(r.qps[0].state, QpState::Rts, "{e}");
            assert!(e.to_string().contains("not observable"), "{e}");
        }
    }
    // the cache's eviction on mlx5 does not wait for what it cannot see, nor count it forced
    pd.reg_cache().clear();
    let st = pd.reg_cache().stats();
    assert_eq!((st.entries, st.evictions, st.forced_evictions), (0, 1, 0));
}

// ---------------------------------------------------------------------------------------------
// Error completions: each class gives the same completion on both backends (a ConnectX's).
// ---------------------------------------------------------------------------------------------

/// What an error completion says: (responder, syndrome, opcode of the failed WQE, its counter).
fn error_of(c: Completion) -> (bool, Option<Syndrome>, u8, u16) {
    match c {
        Completion::Error(e) => (e.responder, e.syndrome(), e.wqe_opcode, e.wqe_counter),
        c => panic!("not an error completion: {c:?}"),
    }
}

const RDMA_WRITE: u8 = 0x08;
const SEND: u8 = 0x0a;
const RDMA_READ: u8 = 0x10;

#[test]
fn a_bad_rkey_is_remote_access_and_the_qp_goes_to_err() {
    let (a, b) = connected(DoorbellMode::Auto);
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let mut bad = b.mr.remote(0);
    bad.rkey = prm::Rkey(bad.rkey.0 ^ 0x80);
    let w = Op::Write {
        remote: bad,
        local: Local::Sges(&[a.mr.sge(0, 64)]),
        imm: None,
    };
    assert_eq!(ini.post_and_ring(&w, CtrlFlags::SIGNALED), Ok(0));
    assert_eq!(
        error_of(ini.wait_send(T).unwrap()),
        (false, Some(Syndrome::RemoteAccess), RDMA_WRITE, 0)
    );
    assert_eq!(a.qp.state(), QpState::Err);
    assert_eq!(b.buf.to_vec()[..64], [0; 64], "nothing was written");
    // the responder NAKed an access violation: it is in ERR too (a ConnectX's QP_ACCESS_ERR)
    assert_eq!(b.qp.state(), QpState::Err);

    // a READ past the end of a region with a good rkey: the same class
    let (a, b) = connected(DoorbellMode::Auto);
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let r = Op::Read {
        remote: b.mr.remote(8192 - 8),
        local: &[a.mr.sge(0, 16)],
    };
    ini.post_and_ring(&r, CtrlFlags::SIGNALED).unwrap();
    assert_eq!(
        error_of(ini.wait_send(T).unwrap()),
        (false, Some(Syndrome::RemoteAccess), RDMA_READ, 0)
    );
    assert_eq!(a.qp.state(), QpState::Err);
}

#[test]
fn a_bad_lkey_is_local_prot() {
    let (a, b) = connected(DoorbellMode::Auto);
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    // one good WRITE first: the failing one is WQE 1
    let good = Op::Write {
        remote: b.mr.remote(0),
        local: Local::Sges(&[a.mr.sge(0, 8)]),
        imm: None,
    };
    ini.post_and_ring(&good, CtrlFlags::SIGNALED).unwrap();
    ok(ini.wait_send(T).unwrap());
    let mut sge = a.mr.sge(0, 64);
    sge.lkey = prm::Lkey(sge.lkey.0 ^ 0x80);
    let w = Op::Write {
        remote: b.mr.remote(64),
        local: Local::Sges(&[sge]),
        imm: None,
    };
    assert_eq!(ini.post_and_ring(&w, CtrlFlags::SIGNALED), Ok(1));
    assert_eq!(
        error_of(ini.wait_send(T).unwrap()),
        (false, Some(Syndrome::LocalProt), RDMA_WRITE, 1)
    );
    assert_eq!(a.qp.state(), QpState::Err);
    assert_eq!(b.buf.to_vec()[64..128], [0; 64], "nothing was written");
}

#[test]
fn a_send_longer_than_the_receive_is_remote_inval_req_and_local_length() {
    let (a, b) = connected(DoorbellMode::Auto);
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let mut resp = b.qp.cpu_initiator(RingMode::RdmaCore);
    resp.post_recv(&[b.mr.sge(0, 128)]).unwrap();
    let s = Op::Send {
        local: Local::Sges(&[a.mr.sge(0, 512)]),
        imm: None,
    };
    ini.post_and_ring(&s, CtrlFlags::SIGNALED).unwrap();
    // the sender: the responder NAKed it as an invalid request
    assert_eq!(
        error_of(ini.wait_send(T).unwrap()),
        (false, Some(Syndrome::RemoteInvalReq), SEND, 0)
    );
    // the receiver: its receive WQE 0 completes with a local length error
    let (responder, syndrome, _, counter) = error_of(resp.wait_recv(T).unwrap());
    assert_eq!(
        (responder, syndrome, counter),
        (true, Some(Syndrome::LocalLength), 0)
    );
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Err, QpState::Err));
}

#[test]
fn a_qp_in_err_flushes_what_it_holds_and_what_is_posted() {
    let (a, b) = connected(DoorbellMode::Auto);
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let mut resp = b.qp.cpu_initiator(RingMode::RdmaCore);
    // a receive posted before the QP is moved to ERR is flushed by the move
    resp.post_recv(&[b.mr.sge(0, 64)]).unwrap();
    b.qp.modify(gpuverbs::Modify::Err).unwrap();
    assert_eq!(b.qp.state(), QpState::Err);
    let (responder, syndrome, _, counter) = error_of(resp.wait_recv(T).unwrap());
    assert_eq!(
        (responder, syndrome, counter),
        (true, Some(Syndrome::WrFlush), 0)
    );
    // and one posted after it, too
    resp.post_recv(&[b.mr.sge(64, 64)]).unwrap();
    let (responder, syndrome, _, counter) = error_of(resp.wait_recv(T).unwrap());
    assert_eq!(
        (responder, syndrome, counter),
        (true, Some(Syndrome::WrFlush), 1)
    );
    // posting on a QP in ERR is accepted (the provider checks no state) and flushed
    a.qp.modify(gpuverbs::Modify::Err).unwrap();
    let w = Op::Write {
        remote: b.mr.remote(0),
        local: Local::Sges(&[a.mr.sge(0, 8)]),
        imm: None,
    };
    for i in 0..2u16 {
        assert_eq!(ini.post_and_ring(&w, CtrlFlags::SIGNALED), Ok(i));
        let (responder, syndrome, _, counter) = error_of(ini.wait_send(T).unwrap());
        assert_eq!(
            (responder, syndrome, counter),
            (false, Some(Syndrome::WrFlush), i)
        );
    }
    assert_eq!(b.buf.to_vec()[..8], [0; 8], "nothing was written");
}

#[test]
fn no_receive_without_rnr_retries_is_rnr_retry_exc() {
    let (a, b) = connected_with(
        DoorbellMode::Auto,
        ConnectOptions {
            rnr_retry: 0,
            ..all_rights()
        },
    );
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let s = Op::Send {
        local: Local::Sges(&[a.mr.sge(0, 8)]),
        imm: None,
    };
    ini.post_and_ring(&s, CtrlFlags::SIGNALED).unwrap();
    assert_eq!(
        error_of(ini.wait_send(T).unwrap()),
        (false, Some(Syndrome::RnrRetryExc), SEND, 0)
    );
    // only the requester fails: the responder that had no receive stays in RTS
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Err, QpState::Rts));
}

#[test]
fn a_vanished_peer_is_transport_retry_exc() {
    let (a, b) = connected_with(
        DoorbellMode::Auto,
        ConnectOptions {
            timeout: 8,
            retry_cnt: 1,
            ..all_rights()
        },
    );
    let target = b.mr.remote(0);
    drop(b); // its QP is destroyed: nothing answers
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let w = Op::Write {
        remote: target,
        local: Local::Sges(&[a.mr.sge(0, 8)]),
        imm: None,
    };
    ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    assert_eq!(
        error_of(ini.wait_send(T).unwrap()),
        (false, Some(Syndrome::TransportRetryExc), RDMA_WRITE, 0)
    );
    assert_eq!(a.qp.state(), QpState::Err);
}

/// Writes `len` bytes of `seed`'s pattern from A's buffer to B's at `off` and checks them.
fn write_checked(
    ini: &mut gpuverbs::post::CpuInitiator,
    a: &Side,
    b: &Side,
    off: usize,
    len: usize,
    seed: u8,
) {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect();
    a.buf.write(off, &data);
    let w = Op::Write {
        remote: b.mr.remote(off as u64),
        local: Local::Sges(&[a.mr.sge(off as u64, len as u32)]),
        imm: None,
    };
    ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    ok(ini.wait_send(T).unwrap());
    assert_eq!(
        b.buf.to_vec()[off..off + len],
        data[..],
        "the bytes arrived"
    );
}

#[test]
fn a_qp_in_err_recovers_drained_with_fresh_psns_and_traffic_resumes() {
    let (a, b) = connected(DoorbellMode::Auto);
    let (psn_a, psn_b) = (a.qp.psn(), b.qp.psn());
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let mut resp = b.qp.cpu_initiator(RingMode::RdmaCore);
    write_checked(&mut ini, &a, &b, 0, 64, 1);
    // two receives wait on B; then a WRITE with a bad rkey and three behind it
    resp.post_recv(&[b.mr.sge(4096, 64)]).unwrap();
    resp.post_recv(&[b.mr.sge(4160, 64)]).unwrap();
    let mut bad = b.mr.remote(64);
    bad.rkey = prm::Rkey(bad.rkey.0 ^ 0x80);
    let sge = [a.mr.sge(64, 64)];
    let w = |remote| Op::Write {
        remote,
        local: Local::Sges(&sge),
        imm: None,
    };
    ini.post(&w(bad), CtrlFlags::SIGNALED).unwrap();
    for i in 0..3 {
        ini.post(&w(b.mr.remote(128 + 64 * i)), CtrlFlags::SIGNALED)
            .unwrap();
    }
    ini.ring();
    let t0 = std::time::Instant::now();
    while a.qp.state() != QpState::Err {
        assert!(t0.elapsed() < T, "the bad rkey did not fail the QP");
        std::thread::sleep(Duration::from_millis(1));
    }
    // nobody polls: the poster goes away with its completions still in the CQ
    drop((ini, resp));
    // a poster holds the QP: no recovery under it
    let holder = a.qp.cpu_initiator(RingMode::RdmaCore);
    assert!(matches!(a.qp.recover(T), Err(Error::PosterBusy { .. })));
    drop(holder);

    let da = a.qp.recover(T).unwrap();
    let errs: Vec<_> = da.send.iter().map(|&c| error_of(c)).collect();
    assert_eq!(
        errs,
        [
            (false, Some(Syndrome::RemoteAccess), RDMA_WRITE, 1),
            (false, Some(Syndrome::WrFlush), RDMA_WRITE, 2),
            (false, Some(Syndrome::WrFlush), RDMA_WRITE, 3),
            (false, Some(Syndrome::WrFlush), RDMA_WRITE, 4),
        ],
        "{da:?}"
    );
    assert!(da.recv.is_empty(), "{da:?}");
    // the responder NAKed the access violation and is in ERR: its receives are flushed
    assert_eq!(b.qp.state(), QpState::Err);
    let db = b.qp.recover(T).unwrap();
    let flushed: Vec<_> = db.recv.iter().map(|&c| error_of(c)).collect();
    assert_eq!(flushed.len(), 2, "{db:?}");
    for (i, (responder, syndrome, _, counter)) in flushed.into_iter().enumerate() {
        assert_eq!(
            (responder, syndrome, counter),
            (true, Some(Syndrome::WrFlush), i as u16)
        );
    }
    assert_eq!(db.errors().count(), 2);
    assert!(
        b.buf.to_vec()[64..384].iter().all(|&x| x == 0),
        "nothing written past the error"
    );

    // both in RESET with new PSNs; the endpoints carry them
    assert_eq!(
        (a.qp.state(), b.qp.state()),
        (QpState::Reset, QpState::Reset)
    );
    assert_ne!((a.qp.psn(), b.qp.psn()), (psn_a, psn_b));
    assert_eq!(a.qp.endpoint().psn(), a.qp.psn());
    // recovering a QP in RESET drains nothing and draws another PSN
    let again = a.qp.recover(T).unwrap();
    assert!(again.send.is_empty() && again.recv.is_empty());

    a.qp.connect(&b.qp.endpoint(), all_rights()).unwrap();
    b.qp.connect(&a.qp.endpoint(), all_rights()).unwrap();
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    let mut resp = b.qp.cpu_initiator(RingMode::RdmaCore);
    // the queues start afresh: WQE 0 again, every byte lands
    for i in 0..40u8 {
        write_checked(&mut ini, &a, &b, 64 * (i as usize % 32), 64, i);
    }
    resp.post_recv(&[b.mr.sge(4096, 256)]).unwrap();
    let s = Op::Send {
        local: Local::Sges(&[a.mr.sge(0, 100)]),
        imm: None,
    };
    ini.post_and_ring(&s, CtrlFlags::SIGNALED).unwrap();
    ok(ini.wait_send(T).unwrap());
    match resp.wait_recv(T).unwrap() {
        Completion::Resp {
            wqe_counter,
            byte_cnt,
            ..
        } => assert_eq!((wqe_counter, byte_cnt), (0, 100)),
        c => panic!("{c:?}"),
    }
    assert_eq!(b.buf.to_vec()[4096..4196], a.buf.to_vec()[..100]);
}

#[test]
fn a_qp_recovers_against_a_restarted_peer() {
    let o = ConnectOptions {
        timeout: 8,
        retry_cnt: 1,
        ..all_rights()
    };
    let (a, b) = connected_with(DoorbellMode::Auto, o);
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    write_checked(&mut ini, &a, &b, 0, 256, 3);
    let target = b.mr.remote(0);
    drop(b); // the peer goes away: nothing answers
    let w = Op::Write {
        remote: target,
        local: Local::Sges(&[a.mr.sge(0, 8)]),
        imm: None,
    };
    ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    // the survivor learns of it within its retry budget (2 tries of ~1 ms at timeout 8)
    assert_eq!(
        error_of(ini.wait_send(T).unwrap()),
        (false, Some(Syndrome::TransportRetryExc), RDMA_WRITE, 1)
    );
    drop(ini);
    let d = a.qp.recover(T).unwrap();
    assert!(d.send.is_empty() && d.recv.is_empty(), "{d:?}");
    // the peer starts again: a new QP, a new endpoint
    let b = side(common::open_peer(), DoorbellMode::Auto);
    a.qp.connect(&b.qp.endpoint(), o).unwrap();
    b.qp.connect(&a.qp.endpoint(), o).unwrap();
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    for i in 0..8 {
        write_checked(&mut ini, &a, &b, 512 * i, 512, i as u8);
    }
}

#[test]
fn a_recovery_that_cannot_drain_says_so_and_leaves_the_qp_in_err() {
    let (a, b) = connected(DoorbellMode::Auto);
    if common::skipped_on_mlx5(
        &a.ctx,
        "a_recovery_that_cannot_drain_says_so_and_leaves_the_qp_in_err",
        "needs the soft NIC's fault injection (a dropped doorbell)",
    ) {
        return;
    }
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    a.qp.soft()
        .unwrap()
        .inject(gpuverbs::soft::Fault::DropDoorbells(1));
    let w = Op::Write {
        remote: b.mr.remote(0),
        local: Local::Sges(&[a.mr.sge(0, 8)]),
        imm: None,
    };
    ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
    drop(ini);
    let e = a.qp.recover(Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Drain {
                send_blocks: 1,
                receives: 0,
                overrun: false,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("1 send blocks"), "{e}");
    assert_eq!(a.qp.state(), QpState::Err);
    // the application may give the WQE up: RESET by hand, then connect again
    a.qp.modify(gpuverbs::Modify::Reset).unwrap();
    a.qp.connect(&b.qp.endpoint(), all_rights()).unwrap();
    b.qp.modify(gpuverbs::Modify::Reset).unwrap();
    b.qp.connect(&a.qp.endpoint(), all_rights()).unwrap();
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    write_checked(&mut ini, &a, &b, 0, 64, 9);
}

#[test]
fn a_recovery_counts_receives_flushed_before_it_took_over() {
    // receives on a CQ of their own, flushed by the device before the recovery's poster takes
    // over (their CQEs wait in the CQ, untaken): each is drained once, and the queue is usable
    let ctx = common::open();
    let pd = ctx.alloc_pd();
    let (scq, rcq) = (
        ctx.create_cq(CqOptions::default()).unwrap(),
        ctx.create_cq(CqOptions::default()).unwrap(),
    );
    let qp = pd.create_qp(QpOptions::new(&scq, &rcq)).unwrap();
    let buf = HostBuffer::new(4096);
    let mr = pd.register_with(&buf, Access::LOCAL_WRITE).unwrap();
    let peer = side(common::open_peer(), DoorbellMode::Auto);
    qp.connect(&peer.qp.endpoint(), all_rights()).unwrap();
    let mut ini = qp.cpu_initiator(RingMode::RdmaCore);
    for i in 0..3 {
        ini.post_recv(&[mr.sge(64 * i, 64)]).unwrap();
    }
    drop(ini);
    qp.modify(gpuverbs::Modify::Err).unwrap();
    if let Some(q) = qp.soft() {
        let t0 = std::time::Instant::now();
        while q.rq_consumer() != 3 {
            assert!(t0.elapsed() < T, "the receives were not flushed");
            std::thread::sleep(Duration::from_millis(1));
        }
    } else {
        std::thread::sleep(Duration::from_millis(50));
    }
    let d = qp.recover(T).unwrap();
    let counters: Vec<_> = d.recv.iter().map(|&c| error_of(c)).collect();
    assert_eq!(
        counters,
        (0..3)
            .map(|i| (true, Some(Syndrome::WrFlush), 0, i))
            .collect::<Vec<_>>()
    );
    qp.connect(&peer.qp.endpoint(), all_rights()).unwrap();
    let mut ini = qp.cpu_initiator(RingMode::RdmaCore);
    for i in 0..256 {
        ini.post_recv(&[mr.sge(0, 64)])
            .unwrap_or_else(|e| panic!("receive {i} of a fresh 256-entry RQ: {e}"));
    }
}
