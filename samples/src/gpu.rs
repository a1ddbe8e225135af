//! The GPU side: what the kernels in `kernels/src/samples.cu` are given ([`BwJob`],
//! [`LatSide`], [`arg`], [`upload`], [`Exports`]) and how their status comes back
//! ([`GpuStatus`]).

use anyhow::{bail, Context as _, Result};
use gpuverbs::gpu::{DeviceMem, ExportedQp, Gpu};
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::Qp;
use std::ffi::c_void;
use std::sync::Arc;

/// One QP's share of a `put_bw` run, as `gv_sample_put_bw` reads it (`samples::bw_job`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BwJob {
    /// Exported descriptor (`gpuverbs_qp*`).
    pub qp: u64,
    /// NIC address of source slot 0.
    pub lbase: u64,
    /// Remote address of the job's destination slot 0.
    pub rbase: u64,
    /// lkey of the sources.
    pub lkey: u32,
    /// rkey of the destinations.
    pub rkey: u32,
    /// Threads that drive the QP.
    pub workers: u32,
    /// Destination slots (a multiple of `workers`).
    pub dst_slots: u32,
    /// Source slots.
    pub src_slots: u32,
    /// Iteration i reads source slot (i + src_shift) % src_slots.
    pub src_shift: u32,
    /// Source slot 0 as the GPU sees it (inline WQEs copy from it; 0 when none go inline).
    pub src_dev: u64,
}
const _: () = assert!(std::mem::size_of::<BwJob>() == 56);

/// One side of a latency test's ping-pong, as `gv_sample_verb_lat` reads it (`samples::lat_side`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LatSide {
    /// Exported descriptor.
    pub qp: u64,
    /// NIC address of the outgoing payload.
    pub src_nic: u64,
    /// GPU address of the outgoing payload (the kernel writes its tail).
    pub src_dev: u64,
    /// Remote address the payload goes to.
    pub dst_remote: u64,
    /// GPU address of the aligned 8-byte word that ends the incoming payload.
    pub recv_dev: u64,
    /// The peer's signal word (remote address).
    pub sig_remote: u64,
    /// The own signal word (GPU address).
    pub sig_dev: u64,
    /// lkey of the payload.
    pub lkey: u32,
    /// rkey of the peer's receive buffer.
    pub rkey: u32,
    /// rkey of the peer's signal word.
    pub sig_rkey: u32,
    /// WRITE and SEND: bytes from the outgoing payload's first copy to its second (message
    /// k+1 goes from copy (k+1) % 2, so the kernel may write the next message's tail while the
    /// NIC may still read the last one).
    pub src_stride: u32,
}
const _: () = assert!(std::mem::size_of::<LatSide>() == 72);

/// A pointer to a kernel parameter.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// Copies plain values into new GPU memory.
pub fn upload<T: bytemuck::Pod>(gpu: &Arc<Gpu>, v: &[T]) -> Result<DeviceMem> {
    let bytes: &[u8] = bytemuck::cast_slice(v);
    let mem = gpu.alloc(bytes.len())?;
    mem.write(0, bytes)?;
    Ok(mem)
}

/// The status words the sample kernels report: [status, syndrome, vendor, wqe_counter, who].
pub struct GpuStatus {
    mem: DeviceMem,
}

impl GpuStatus {
    /// Zeroed status words.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self> {
        Ok(Self {
            mem: gpu.alloc(32)?,
        })
    }
    /// Device address for the kernel.
    pub fn ptr(&self) -> u64 {
        self.mem.ptr()
    }
    /// Clears the words before a launch.
    pub fn reset(&self) -> Result<()> {
        Ok(self.mem.write(0, &[0u8; 32])?)
    }
    /// The eight status words as the kernel left them (words 5..7 are a kernel's own counts,
    /// e.g. `gv_sample_verb_lat`'s mismatches).
    pub fn words(&self) -> Result<[i32; 8]> {
        let mut b = [0u8; 32];
        self.mem.read(0, &mut b)?;
        Ok(bytemuck::cast(b))
    }
    /// Fails with the decoded status unless every thread reported OK. `qpn(who)` names the QP
    /// of job/side `who`.
    pub fn check(&self, what: &str, qpn: impl Fn(usize) -> u32) -> Result<()> {
        let mut b = [0u8; 32];
        self.mem.read(0, &mut b)?;
        let s: [i32; 8] = bytemuck::cast(b);
        match s[0] {
            0 => Ok(()),
            1 => {
                let e = gpuverbs::post::ErrorCqe {
                    responder: false,
                    syndrome: s[1] as u8,
                    vendor_syndrome: s[2] as u8,
                    wqe_opcode: gpuverbs::post::Opcode::RdmaWrite as u8,
                    qpn: qpn(s[4].max(0) as usize),
                    wqe_counter: s[3] as u16,
                };
                bail!("{what}: a completion carries an error: {e}")
            }
            2 => bail!(
                "{what}: a wait in the kernel ran out of its budget (TIMEOUT) on QP {:#x}: the \
                 device stopped answering",
                qpn(s[4].max(0) as usize)
            ),
            3 => bail!("{what}: the kernel refused an argument (INVALID)"),
            x => bail!("{what}: the kernel reported unknown status {x}"),
        }
    }
}

/// QPs exported to a GPU, and the proxy thread that rings for them in CPU-proxy mode.
pub struct Exports {
    /// One descriptor per QP, in the order given.
    pub qps: Vec<ExportedQp>,
    // Dropped after the descriptors: the proxy stops before the QPs go.
    _proxy: Option<ProxyService>,
}

impl Exports {
    /// Exports `qps` to `gpu`; starts a proxy thread when their doorbell mode is CPU proxy.
    pub fn new(gpu: &Arc<Gpu>, qps: &[&Qp]) -> Result<Self> {
        let mut out = Vec::with_capacity(qps.len());
        for q in qps {
            out.push(gpu.export_qp(q).context("export a QP to the GPU")?);
        }
        let proxied: Vec<&&Qp> = qps.iter().filter(|q| q.doorbell().0.proxied()).collect();
        let proxy = if proxied.is_empty() {
            None
        } else {
            let svc = ProxyService::start(ProxyConfig::default()).context("start the CPU proxy")?;
            for q in proxied {
                // The service releases its targets when it is dropped.
                let _handle = svc.add(ProxyTarget::for_qp(q)?)?;
            }
            Some(svc)
        };
        Ok(Self {
            qps: out,
            _proxy: proxy,
        })
    }
}
