//! The backend the host-API tests run on: the chosen one (`DeviceRequest::Auto`). Here and in
//! CI's `cargo test` that is the soft NIC; under `gpuverbs emu --devices 2` (CI runs these
//! tests again that way) it is the mlx5 backend on `mlx5_0`, through the real libibverbs and
//! libmlx5, and the peer of a connection is on `mlx5_1`.
//!
//! A test that needs a soft-NIC-only feature asserts what the mlx5 backend documents instead
//! (an error, a refusal) where there is something to assert, and says on stderr what it
//! skipped ([`skipped_on_mlx5`]); it never passes silently.

#![allow(dead_code)] // each test binary uses its own part

use gpuverbs::device::BackendKind;
use gpuverbs::post::RingMode;
use gpuverbs::{Access, ConnectOptions, Context, Cq, CqOptions, DeviceRequest, Error};
use gpuverbs::{HostBuffer, Mr, Qp, QpOptions};
use std::sync::Arc;
use verbs::initiator::{CqGeometry, Initiator, RqGeometry, SqGeometry};

/// A context on the chosen backend (`DeviceRequest::Auto`: an rdma-core device when rdma-core
/// lists one, else a soft NIC).
pub fn open() -> Context {
    Context::open(DeviceRequest::Auto).expect("Context::open(Auto)")
}

/// A context for the other end of a connection, on the same backend as [`open`]: another soft
/// NIC, or on rdma-core `mlx5_1` (the second device of `gpuverbs emu --devices 2`) when it is
/// listed and is not the chosen device, else another context on the chosen device.
pub fn open_peer() -> Context {
    let first = open();
    if !is_mlx5(&first) {
        return first;
    }
    let second = "mlx5_1";
    if first.selection().name != second {
        match Context::open(DeviceRequest::Named(second.into())) {
            Ok(c) => return c,
            Err(Error::NoSuchDevice(_)) => {}
            Err(e) => panic!("Context::open({second}): {e}"),
        }
    }
    first
}

/// Whether `ctx` is on the mlx5 (rdma-core) backend.
pub fn is_mlx5(ctx: &Context) -> bool {
    ctx.selection().kind == BackendKind::Mlx5
}

/// On the mlx5 backend: prints `skipped on mlx5: <test>: <why>` and returns true, for the part
/// of a test that needs a soft-NIC-only feature (the caller has asserted, before, whatever the
/// mlx5 backend documents for it). On the soft NIC: false.
pub fn skipped_on_mlx5(ctx: &Context, test: &str, why: &str) -> bool {
    let skip = is_mlx5(ctx);
    if skip {
        eprintln!("skipped on mlx5: {test}: {why}");
    }
    skip
}

/// A kernel's side of a soft QP, played by the CPU: WQEs into the QP's own SQ ring, the doorbell
/// (the DOCA convention, as the device API rings) into its register at `bf_offset`, and the
/// doorbell record's send word into `decoy`, so the QP's own record is never written by the
/// player (the no-DBR tests check who wrote it).
pub fn decoy_player(s: &Arc<gpuverbs::soft::raw::Qp>, decoy: &Arc<verbs::DmaBuf>) -> Initiator {
    let record = s.dbrec_page().as_ptr().wrapping_add(s.dbrec_offset());
    let cq_geom = |c: &gpuverbs::soft::raw::Cq| CqGeometry {
        ring: c.ring().as_ptr(),
        ncqe: c.ncqe(),
        dbrec: c.dbrec().as_ptr(),
        collapsed: false,
    };
    let sq = SqGeometry {
        ring: s.sq_ring().as_ptr(),
        blocks: s.sq_blocks(),
        dbrec: decoy.as_ptr(),
        bf_reg: s.uar().as_ptr().wrapping_add(s.bf_offset()),
        qpn: s.qpn(),
    };
    let rq = RqGeometry {
        ring: s.rq_ring().as_ptr(),
        wqes: s.rq_wqes(),
        stride: s.rq_stride(),
        dbrec: record,
    };
    let keep: Arc<dyn std::any::Any + Send + Sync> = Arc::new((s.clone(), decoy.clone()));
    // SAFETY: the rings, CQs and register are the live soft QP's (kept by `keep`), host
    // memory; the decoy record is a live 64-byte buffer (kept too); the caller is the QP's
    // only poster and its CQ's only poller.
    unsafe {
        Initiator::from_geometry(
            sq,
            rq,
            cq_geom(s.send_cq()),
            cq_geom(s.recv_cq()),
            RingMode::Doca,
            keep,
            None,
        )
    }
}

/// Two QPs connected for WRITEs: `qp` on `ctx`, made with the options `o` gives for its CQ, and
/// a plain one on `peer`; a 4 KiB source holding `text`, registered on `qp`'s PD, and a 4 KiB
/// destination registered for remote writes on the peer's.
pub struct WritePair {
    pub qp: Qp,
    pub qp_b: Qp,
    pub src: HostBuffer,
    pub dst: HostBuffer,
    pub src_mr: Mr,
    pub dst_mr: Mr,
}

pub fn write_pair(
    ctx: &Context,
    peer: &Context,
    o: impl FnOnce(&Cq) -> QpOptions,
    text: &[u8],
) -> WritePair {
    let (pd, pd_b) = (ctx.alloc_pd(), peer.alloc_pd());
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let qp = pd.create_qp(o(&cq)).unwrap();
    let cq_b = peer.create_cq(CqOptions::default()).unwrap();
    let qp_b = pd_b.create_qp(QpOptions::new(&cq_b, &cq_b)).unwrap();
    let c = ConnectOptions {
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ..Default::default()
    };
    qp.connect(&qp_b.endpoint(), c).unwrap();
    qp_b.connect(&qp.endpoint(), c).unwrap();
    let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
    src.write(0, text);
    let src_mr = pd.register_with(&src, Access::LOCAL_WRITE).unwrap();
    let dst_mr = pd_b
        .register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    WritePair {
        qp,
        qp_b,
        src,
        dst,
        src_mr,
        dst_mr,
    }
}
