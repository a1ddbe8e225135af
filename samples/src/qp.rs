//! Making and connecting QPs: [`QpSpec`], [`create_qp`], [`connect_pair`] at the MTU of `-m`,
//! the SQ size ([`tx_depth_for`]), and the doorbell (the CPU initiator's ring mode, the names
//! and the header line that describe it).

use crate::args::{DbArg, Initiator, RingsArg, MAX_TX_DEPTH};
use anyhow::{bail, Context as _, Result};
use gpuverbs::gpu::Gpu;
use gpuverbs::post::RingMode;
use gpuverbs::{Access, ConnectOptions, CqOptions, DoorbellMode, Endpoint, Pd, Qp, QpOptions};
use std::sync::Arc;

/// The doorbell convention a CPU initiator uses for a QP created with `db`, or why it cannot.
pub fn cpu_ring_mode(db: DbArg) -> Result<RingMode> {
    match db {
        // The device API rings with the DOCA convention; the CPU does the same.
        DbArg::Auto | DbArg::Gpu => Ok(RingMode::Doca),
        DbArg::Bf => Ok(RingMode::BlueFlame),
        DbArg::Proxy => bail!(
            "--db proxy: the CPU proxy rings doorbells for kernels; the CPU initiator rings its \
             own (use --initiator gpu, or --db auto|gpu|bf)"
        ),
    }
}

/// What the CPU initiator writes to ring a doorbell in `ring` mode (the header's and the
/// JSON's doorbell reason of a CPU run: the QP's own reason is about the GPU mapping, which a
/// CPU run does not use).
pub fn cpu_doorbell_reason(db: DbArg, ring: RingMode) -> String {
    let how = match ring {
        RingMode::RdmaCore => {
            "the doorbell record, then the first 8 bytes of the last WQE's ctrl segment to the \
             doorbell register (rdma-core convention)"
        }
        RingMode::Doca => {
            "the doorbell record, then {BE32(pi << 8), BE32(qpn << 8)} to the doorbell register \
             (DOCA convention)"
        }
        RingMode::BlueFlame => {
            "the doorbell record, then the whole WQE into the BlueFlame register"
        }
    };
    let db = match db {
        DbArg::Auto => "auto",
        DbArg::Gpu => "gpu",
        DbArg::Bf => "bf",
        DbArg::Proxy => "proxy",
    };
    format!("--db {db}: the CPU initiator writes {how}")
}

/// The doorbell line of the header: the QP's mode as resolved, why, and who rings (a CPU run
/// says what the CPU initiator writes, [`cpu_doorbell_reason`]).
pub fn doorbell_line(qp: &Qp, initiator: Initiator, ring: Option<RingMode>, db: DbArg) -> String {
    let (mode, why) = qp.doorbell();
    let name = doorbell_name(mode);
    match (initiator, ring) {
        (Initiator::Cpu, Some(r)) => format!("{name} ({})", cpu_doorbell_reason(db, r)),
        (Initiator::Gpu, _) if mode == DoorbellMode::CpuProxy => {
            format!("{name} ({why}); a host proxy thread rings for the kernels")
        }
        (Initiator::Gpu, _) if mode == DoorbellMode::NoDbrEmulated => {
            format!("{name} ({why}); rung by the kernels, a host proxy thread keeps the record")
        }
        _ => format!("{name} ({why}); rung by the kernels"),
    }
}

/// Short name of a doorbell mode (JSON and header).
pub fn doorbell_name(m: DoorbellMode) -> &'static str {
    match m {
        DoorbellMode::Auto => "auto",
        DoorbellMode::GpuDoorbell => "gpu-doorbell",
        DoorbellMode::BlueFlame => "blueflame",
        DoorbellMode::CpuProxy => "cpu-proxy",
        DoorbellMode::NoDbr => "no-dbr",
        DoorbellMode::NoDbrEmulated => "no-dbr-emulated",
    }
}

/// How the samples make QPs.
#[derive(Clone, Copy, Debug)]
pub struct QpSpec {
    /// SQ blocks (power of two); the QP's CQ gets as many entries (one CQE per block at most).
    pub tx_depth: u32,
    /// Ring placement.
    pub rings: RingsArg,
    /// Doorbell mode.
    pub db: DbArg,
}

/// An RC QP with a CQ of its own (send and receive), as `spec` says; rings in GPU memory
/// (`--rings gpu`) are allocated on `gpu` (`Context::create_cq_on` / `Pd::create_qp_on`).
pub fn create_qp(pd: &Pd, spec: QpSpec, gpu: Option<&Arc<Gpu>>) -> Result<Qp> {
    make_qp(pd, spec, gpu, None)
}

/// A QP like [`create_qp`]'s with a receive queue of `rq_wqes` receives (rounded up to a power
/// of two) and a receive CQ of its own (the device API's `post_recv` / `recv_wait` and the CPU
/// initiator's `poll_recv` take receive completions from it).
pub fn create_qp_rq(pd: &Pd, spec: QpSpec, gpu: Option<&Arc<Gpu>>, rq_wqes: u32) -> Result<Qp> {
    make_qp(pd, spec, gpu, Some(rq_wqes.max(1).next_power_of_two()))
}

fn make_qp(pd: &Pd, spec: QpSpec, gpu: Option<&Arc<Gpu>>, rq: Option<u32>) -> Result<Qp> {
    let placement = spec.rings.placement();
    // a GPU to place rings for: given (the GPU initiator), unless host rings are asked for
    let gpu = gpu.filter(|_| spec.rings != RingsArg::Host);
    if spec.rings == RingsArg::Gpu && gpu.is_none() {
        bail!(
            "--rings gpu: rings in GPU memory need a GPU (and the GPU initiator; use --rings host)"
        );
    }
    let ctx = pd.context();
    let co = CqOptions {
        depth: spec.tx_depth.max(64),
        placement,
        ..Default::default()
    };
    let cq = match gpu {
        Some(g) => ctx.create_cq_on(g, co),
        None => ctx.create_cq(co),
    }
    .with_context(|| format!("--rings {}: create a CQ", spec.rings.name()))?;
    let rcq = match rq {
        None => cq.clone(),
        Some(n) => {
            let co = CqOptions {
                depth: n.max(64),
                placement,
                ..Default::default()
            };
            match gpu {
                Some(g) => ctx.create_cq_on(g, co),
                None => ctx.create_cq(co),
            }
            .with_context(|| format!("--rings {}: create a receive CQ", spec.rings.name()))?
        }
    };
    let mut o = QpOptions::new(&cq, &rcq);
    if let Some(n) = rq {
        o.rq_wqes = n;
    }
    o.sq_blocks = spec.tx_depth;
    o.placement = placement;
    o.doorbell = spec.db.mode();
    match gpu {
        Some(g) => pd.create_qp_on(g, o),
        None => pd.create_qp(o),
    }
    .with_context(|| format!("--rings {}: create a QP", spec.rings.name()))
}

/// `ep` with its MTU lowered to `mtu` (`-m`), when given: what this side offers the peer, and
/// what it connects to.
pub fn with_mtu(ep: &Endpoint, mtu: Option<u32>) -> Endpoint {
    match mtu {
        Some(m) if m < ep.mtu() => {
            Endpoint::new(ep.gid(), ep.qpn(), ep.psn(), m, ep.device().to_string())
                .and_then(|e| e.with_udp_port(ep.udp_port()))
                .unwrap_or_else(|_| ep.clone())
        }
        _ => ep.clone(),
    }
}

/// Connects `q` to the peer's endpoint at no more than `mtu` (`-m`).
pub fn connect_mtu(q: &Qp, remote: &Endpoint, mtu: Option<u32>) -> Result<()> {
    q.connect(&with_mtu(remote, mtu), connect_options())?;
    Ok(())
}

/// What the samples' QPs allow their peers: writes, reads and atomics (the regions say which
/// of them each buffer takes).
pub fn connect_options() -> ConnectOptions {
    ConnectOptions {
        access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        ..Default::default()
    }
}

/// Connects two QPs of this process to each other, at no more than `mtu` (`-m`).
pub fn connect_pair(a: &Qp, b: &Qp, mtu: Option<u32>) -> Result<()> {
    connect_mtu(a, &b.endpoint(), mtu).context("connect QP A")?;
    connect_mtu(b, &a.endpoint(), mtu).context("connect QP B")?;
    Ok(())
}

/// The SQ size a run needs: at least `min`, and more than the blocks the posters of one QP can
/// leave without a CQE (unsignaled, or published but not rung yet), so that a full SQ always
/// holds a rung, signaled WQE whose CQE frees space.
pub fn tx_depth_for(min: u32, unsignaled_blocks: u64) -> Result<u32> {
    let need = (unsignaled_blocks + 1).max(min as u64).next_power_of_two();
    if need > MAX_TX_DEPTH as u64 {
        bail!(
            "the posters of one QP may leave {unsignaled_blocks} blocks without a CQE, which needs \
             an SQ of {need} blocks (at most {MAX_TX_DEPTH}): lower --cq-mod or -l (--post_list), or use \
             fewer threads per QP"
        );
    }
    Ok(need as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tx_depth_covers_what_posters_leave_unsignaled() {
        assert_eq!(tx_depth_for(256, 80).unwrap(), 256);
        assert_eq!(tx_depth_for(16, 256).unwrap(), 512);
        assert_eq!(tx_depth_for(100, 10).unwrap(), 128);
        assert!(tx_depth_for(256, 40_000).is_err());
    }
}
