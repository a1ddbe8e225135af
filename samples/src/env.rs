//! The device, the GPU and the initiator of a run: [`open_env`], [`open_env_remote`], and what
//! they check ([`check_placement`], [`soft_nic_options`]).

use crate::args::{device_request, CommonArgs, Initiator, Placement, RingsArg};
use crate::peer::Peer;
use anyhow::{bail, Context as _, Result};
use gpuverbs::gpu::Gpu;
use gpuverbs::Context;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;

pub use crate::resolved::Env;

/// Opens the device and resolves the initiator: `--initiator gpu` needs a GPU with the kernels;
/// without `--initiator`, the GPU is used when it opens, and otherwise the CPU, with the reason.
pub fn open_env(a: &CommonArgs) -> Result<Env> {
    let ctx = Context::open(device_request(a.device.as_deref())).context("open the RDMA device")?;
    resolve_env(a, ctx)
}

/// The server/client roles' device, as `-d` / GPUVERBS_DEVICE (or Auto) picks it, and the
/// initiator as [`open_env`] resolves it.
///
/// - A soft NIC gets a wire port on the local IPv4 address that reaches the peer (the route's
///   source address) and `--wire-port` (GPUVERBS_SOFTNIC_ADDR overrides both), with `--loss`
///   applied to what it sends.
/// - An rdma-core device (the mlx5 backend) is used as it is: its QPs' endpoints carry the
///   RoCE v2 GID of its port, which the peer connects to. The soft NIC's options (`--wire-port`,
///   `--loss`, `--pcap`, GPUVERBS_SOFTNIC_ADDR) are refused ([`soft_nic_options`]).
///
/// Both sides then take the step "open the device": a side that failed (a device that is not
/// there, an option it cannot honour) ends both runs with its reason.
pub fn open_env_remote(a: &CommonArgs, peer: &mut Peer) -> Result<Env> {
    let (env, mine) = match open_remote_device(a, peer).and_then(|c| resolve_env(a, c)) {
        Ok(env) => (Some(env), Ok(())),
        Err(e) => (None, Err(e)),
    };
    peer.step("open the device", mine)?;
    env.context("the device step succeeded without a device")
}

/// The soft-NIC-only settings of the server/client roles that this run gives: what an
/// rdma-core device cannot honour.
pub fn soft_nic_options(a: &CommonArgs) -> Vec<&'static str> {
    let mut v = Vec::new();
    if a.wire_port.is_some() {
        v.push("--wire-port");
    }
    if a.loss.is_some() {
        v.push("--loss");
    }
    if a.pcap.is_some() {
        v.push("--pcap");
    }
    if std::env::var(gpuverbs::device::SOFTNIC_ADDR_ENV).is_ok_and(|v| !v.trim().is_empty()) {
        v.push(gpuverbs::device::SOFTNIC_ADDR_ENV);
    }
    v
}

/// Opens the device of the server/client roles ([`open_env_remote`]).
fn open_remote_device(a: &CommonArgs, peer: &Peer) -> Result<Context> {
    let req = device_request(a.device.as_deref());
    // Where a soft NIC's wire port binds; an rdma-core device needs no address of ours.
    let bind =
        local_ip_towards(peer.addr.ip()).map(|ip| SocketAddr::from((ip, a.wire_port.unwrap_or(0))));
    let ctx = match &bind {
        Ok(b) => Context::open_wire(req, *b).with_context(|| {
            format!("open the RDMA device (a soft NIC gets a wire port on {b})")
        })?,
        // A soft NIC can still be given its address by GPUVERBS_SOFTNIC_ADDR.
        Err(_) => Context::open(req).context("open the RDMA device")?,
    };
    match ctx.selection().kind {
        gpuverbs::device::BackendKind::Mlx5 => {
            let soft = soft_nic_options(a);
            if !soft.is_empty() {
                bail!(
                    "{} {} the soft NIC (its UDP wire port, fault injection, capture), and this \
                     run uses the rdma-core device {} (mlx5 backend), which sends RoCE v2 from \
                     its own port (GID {}): leave {} out, or run on the soft NIC (-d soft)",
                    soft.join(", "),
                    if soft.len() == 1 {
                        "belongs to"
                    } else {
                        "belong to"
                    },
                    ctx.selection().name,
                    gpuverbs::endpoint::Gid::from(ctx.gid()),
                    if soft.len() == 1 { "it" } else { "them" },
                );
            }
        }
        gpuverbs::device::BackendKind::Soft => {
            let dev = ctx
                .soft_device()
                .context("a soft NIC context without its device")?;
            if ctx.wire_addr().is_none() {
                // No wire port: the peer's address gave none, and GPUVERBS_SOFTNIC_ADDR is unset.
                bind.with_context(|| format!("the device {} has no wire port", ctx.selection()))?;
                bail!("the device {} has no wire port", ctx.selection());
            }
            if let Some(pct) = a.loss.filter(|&p| p > 0.0) {
                // One decision sequence per role, the same every run.
                let seed = 0x5eed_0000 + u64::from(peer.bs.rank());
                dev.set_wire_faults(gpuverbs::soft::WireFaults::loss(pct / 100.0, seed))
                    .context("--loss: set the fault injection")?;
            }
        }
    }
    Ok(ctx)
}

/// The source address the kernel picks for packets to `peer`: the local address the peer can
/// answer to (127.0.0.1 for a peer on 127.0.0.1).
pub fn local_ip_towards(peer: IpAddr) -> Result<Ipv4Addr> {
    let v4 = match peer {
        IpAddr::V4(v) => v,
        IpAddr::V6(v) => v.to_ipv4_mapped().with_context(|| {
            format!(
                "the peer is at {v}, an IPv6 address, and the soft NIC's wire speaks IPv4 only: \
                 use its IPv4 address (or set GPUVERBS_SOFTNIC_ADDR)"
            )
        })?,
    };
    let probe = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).context("bind a UDP probe socket")?;
    // A connected UDP socket sends nothing; it only asks the kernel for the route.
    probe
        .connect((v4, 9))
        .with_context(|| format!("no route to the peer's address {v4}"))?;
    match probe
        .local_addr()
        .context("the route's source address")?
        .ip()
    {
        IpAddr::V4(ip) if !ip.is_unspecified() => Ok(ip),
        other => bail!("the route to {v4} has no IPv4 source address (got {other})"),
    }
}

/// Resolves the GPU and the initiator for an opened device.
fn resolve_env(a: &CommonArgs, ctx: Context) -> Result<Env> {
    // The GPU initiator needs a GPU and gpuverbs' kernels (a build without nvcc has none).
    let open_gpu = || -> Result<Arc<Gpu>, gpuverbs::cuda::CudaError> {
        gpuverbs::cuda::fatbin()?;
        Gpu::open(a.gpu)
    };
    let (gpu, gpu_line, initiator, why) = match a.initiator {
        Some(Initiator::Cpu) => (
            None,
            "not used (--initiator cpu)".to_string(),
            Initiator::Cpu,
            "requested".to_string(),
        ),
        Some(Initiator::Gpu) => {
            let g =
                open_gpu().with_context(|| format!("--initiator gpu: cannot use GPU {}", a.gpu))?;
            let line = g.info().to_string();
            (Some(g), line, Initiator::Gpu, "requested".to_string())
        }
        None => match open_gpu() {
            Ok(g) => {
                let line = g.info().to_string();
                let why = format!("auto: GPU {} and the gpuverbs kernels are available", a.gpu);
                (Some(g), line, Initiator::Gpu, why)
            }
            Err(e) => (
                None,
                format!("none usable: {e}"),
                Initiator::Cpu,
                format!("auto: no usable GPU {} (see GPU), so the CPU posts", a.gpu),
            ),
        },
    };
    Ok(Env {
        ctx,
        gpu,
        gpu_line,
        initiator,
        initiator_why: why,
    })
}

/// Refuses the placements this run cannot honour, with the reason. `--rings gpu` needs the
/// GPU initiator (the CPU initiator reads and writes the SQ/CQ rings from the host, so it cannot
/// drive rings in GPU memory). `--mem gpu` needs a GPU and the GPU initiator (the CPU
/// initiator reaches its buffers through host pointers).
pub fn check_placement(a: &CommonArgs, env: &Env) -> Result<()> {
    if a.rings == RingsArg::Gpu && (env.initiator != Initiator::Gpu || env.gpu.is_none()) {
        bail!(
            "--rings gpu: rings in GPU memory are driven by the GPU initiator only, and this run \
             uses the CPU ({}; GPU: {}); the CPU initiator cannot drive GPU-resident rings (use \
             --initiator gpu on a machine with a GPU, or --rings host)",
            env.initiator_why,
            env.gpu_line
        );
    }
    if a.mem == Placement::Host {
        return Ok(());
    }
    if env.gpu.is_none() || env.initiator != Initiator::Gpu {
        bail!(
            "--mem gpu: payload buffers in GPU memory need a GPU and the GPU initiator, and this \
             run has none ({}; initiator: {})",
            env.gpu_line,
            env.initiator_why
        );
    }
    Ok(())
}
