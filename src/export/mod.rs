//! Exporting a QP into a GPU: its rings, doorbell record, doorbell register (or CPU-proxy word)
//! and CQs mapped into the GPU, and its descriptor ([`QpDesc`], laid out in `desc.rs`) written
//! into GPU memory for kernels to drive (its layout, the contract with the kernels, is
//! [`crate::desc`], at the bottom). This is the job of the module that knows both queues and
//! GPUs; [`crate::gpu`] only maps memory and allocates it.

pub use crate::desc::{c_header, db_mode, QpDesc, DESC_VERSION, HEADER_PATH};

use crate::backend::mlx5;
use crate::gpu::{ExportedQp, Gpu};
use crate::memory::{Access, HostBuffer};
use crate::queue::{CqDev, DoorbellMode, Poster, PosterClaim, Qp, QpDev, QueueState};
use crate::Error;
use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use verbs::DmaBuf;

/// Whether kernels built against headers of descriptor version `header_version`
/// (`GPUVERBS_DESC_VERSION`) can drive this library's descriptors: [`Error::DescVersion`] if
/// not. [`Gpu::export_qp_for`] checks it first.
pub fn check_header(header_version: u32) -> Result<(), Error> {
    if header_version == DESC_VERSION {
        Ok(())
    } else {
        Err(Error::DescVersion {
            header: header_version,
            library: DESC_VERSION,
        })
    }
}

impl Gpu {
    /// Exports `qp` for kernels: maps its rings, doorbell record, register page (or proxy word)
    /// and CQs into this GPU and writes a [`QpDesc`] into GPU memory. The export is the QP's
    /// poster ([`crate::queue::Poster`]) until it is dropped: while a CPU initiator or another
    /// export holds the QP this is [`Error::PosterBusy`]. The descriptor's counters start from
    /// the queue's state (`resume_desc`), so a kernel continues where an earlier poster
    /// stopped.
    /// The descriptor is laid out for kernels built against this library's own headers (its
    /// embedded kernels, `gpuverbs-build`'s `include_gpuverbs`); for others, see
    /// [`Gpu::export_qp_for`].
    pub fn export_qp(self: &Arc<Self>, qp: &Qp) -> Result<ExportedQp, Error> {
        self.export_qp_for(qp, DESC_VERSION)
    }

    /// [`Gpu::export_qp`] for kernels built against headers whose `GPUVERBS_DESC_VERSION` is
    /// `header_version` (e.g. kernels compiled at run time, which report the value they saw):
    /// [`Error::DescVersion`] when it is not this library's [`DESC_VERSION`], before anything
    /// is claimed or mapped.
    pub fn export_qp_for(
        self: &Arc<Self>,
        qp: &Qp,
        header_version: u32,
    ) -> Result<ExportedQp, Error> {
        check_header(header_version)?;
        let claim = qp.posters.claim(Poster::GpuExport)?;
        self.export_inner(qp, claim)
    }

    fn export_inner(self: &Arc<Self>, qp: &Qp, claim: PosterClaim) -> Result<ExportedQp, Error> {
        let (Some(s), Some(scq), Some(rcq)) = (qp.soft(), qp.send_cq().soft(), qp.recv_cq().soft())
        else {
            return self.export_mlx5(qp, claim);
        };
        let scratch = HostBuffer::new(64);
        let scratch_mr = qp.pd().register_with(&scratch, Access::LOCAL_WRITE)?;
        let keep_qp: Arc<dyn Any + Send + Sync> = s.clone();
        let map_qp = |b: &DmaBuf| self.gpu_addr(b, keep_qp.clone());
        let ctrl = map_qp(s.ctrl_page())?;
        let uar = map_qp(s.uar())?;
        let map_cq = |cq: &Arc<softnic::Cq>, b: &DmaBuf| self.gpu_addr(b, cq.clone());
        let mode = qp.doorbell().0;
        let desc = QpDesc {
            sq_ring: map_qp(s.sq_ring())?,
            rq_ring: map_qp(s.rq_ring())?,
            dbrec: ctrl + s.dbrec_offset() as u64,
            db_reg: if mode == DoorbellMode::CpuProxy {
                0
            } else {
                uar + prm::doorbell::BF_OFFSET as u64
            },
            proxy_word: if mode == DoorbellMode::CpuProxy {
                ctrl + s.proxy_offset() as u64
            } else {
                0
            },
            scq_ring: map_cq(scq, scq.ring())?,
            scq_dbrec: map_cq(scq, scq.dbrec())?,
            rcq_ring: map_cq(rcq, rcq.ring())?,
            rcq_dbrec: map_cq(rcq, rcq.dbrec())?,
            scratch: self.map_host(&scratch)?,
            sq_blocks: s.sq_blocks(),
            rq_wqes: s.rq_wqes(),
            rq_stride: s.rq_stride(),
            qpn: s.qpn(),
            scq_ncqe: scq.ncqe(),
            rcq_ncqe: rcq.ncqe(),
            db_mode: mode.code(),
            // The WQE release before the doorbell: system scope for a host-memory SQ, GPU
            // scope for one in this GPU's memory (read by the NIC only after the doorbell).
            ring_loc: u32::from(!s.sq_ring().is_host()),
            max_inline: s.max_inline(),
            scratch_lkey: scratch_mr.lkey().0,
            scq_collapsed: (scq.mode() == verbs::CqMode::Collapsed) as u32,
            rcq_collapsed: (rcq.mode() == verbs::CqMode::Collapsed) as u32,
            ..QpDesc::new()
        };
        let mut desc = desc;
        let state = QueueState::of(s);
        resume_desc(&mut desc, &state)?;
        if mode == DoorbellMode::CpuProxy {
            // The kernel's 64-bit producer continues from the queue's (a proxy target made
            // now starts there too).
            s.ctrl_page()
                .atomic_u64(s.proxy_offset())
                .store(state.sq_pi, Ordering::Release);
        }
        let mem = self.alloc(core::mem::size_of::<QpDesc>())?;
        mem.write(0, bytemuck::bytes_of(&desc))?;
        Ok(ExportedQp {
            mem,
            _keep: Box::new(((scratch, scratch_mr), claim)),
        })
    }
}

impl Gpu {
    /// Maps an mlx5 QP's UAR page (its BlueFlame register) into the GPU: as I/O memory first
    /// (real UARs are MMIO), else as plain memory, else an error that says why.
    fn map_uar(&self, q: &mlx5::Qp, keep: &Arc<dyn Any + Send + Sync>) -> Result<u64, Error> {
        let (addr, len) = (q.bf_reg as u64, 2 * prm::doorbell::BF_HALF_SIZE);
        let io_err = match self.map_range(addr, len, keep.clone(), true) {
            Ok(a) => return Ok(a),
            Err(e) => e,
        };
        match self.map_range(addr, len, keep.clone(), false) {
            Ok(a) => {
                tracing::info!(qpn = q.qpn, error = %io_err, "UAR page mapped as plain memory");
                Ok(a)
            }
            Err(e) => Err(Error::Unsupported(format!(
                "the GPU cannot map QP {:#x}'s doorbell page: {io_err}; as plain memory: {e} (on \
                 x86 hosts the NVIDIA driver needs NVreg_RegistryDwords=\"PeerMappingOverride=1;\"; \
                 or use the CPU-proxy doorbell mode)",
                q.qpn
            ))),
        }
    }

    /// Exports a QP of the ConnectX backend: the provider's rings, doorbell record and CQs are
    /// registered into the GPU (`cuMemHostRegister`, DEVICEMAP), the UAR page as I/O memory
    /// (real UARs are MMIO) or, when the driver refuses that, as plain memory; when neither
    /// works the export fails and says why. In the CPU-proxy mode the UAR is not mapped: the
    /// kernel publishes its producer in the QP's proxy word ([`crate::proxy::ProxyTarget::for_qp`]).
    fn export_mlx5(self: &Arc<Self>, qp: &Qp, claim: PosterClaim) -> Result<ExportedQp, Error> {
        let (QpDev::Mlx5(q), CqDev::Mlx5(scq), CqDev::Mlx5(rcq)) =
            (&qp.dev, &qp.send_cq().dev, &qp.recv_cq().dev)
        else {
            return Err(Error::InvalidArgument(
                "a QP on CQs of another device".into(),
            ));
        };
        let mode = qp.doorbell().0;
        if scq.ncqe < q.sq_blocks {
            // rdma-core CQs detect overrun, and the device API bounds the signaled WQEs in
            // flight by the SQ's size, not the CQ's
            return Err(Error::InvalidArgument(format!(
                "QP {:#x}: its send CQ has {} entries for an SQ of {} blocks; a kernel could \
                 overrun it (make the CQ at least as deep as the SQ)",
                q.qpn, scq.ncqe, q.sq_blocks
            )));
        }
        let scratch = HostBuffer::new(64);
        let scratch_mr = qp.pd().register_with(&scratch, Access::LOCAL_WRITE)?;
        let keep_qp: Arc<dyn Any + Send + Sync> = q.clone();
        let map = |addr: *mut u8, len: usize, keep: &Arc<dyn Any + Send + Sync>| {
            self.map_range(addr as u64, len, keep.clone(), false)
        };
        // a doorbell record: mapped from host memory, or (beside GPU rings) already GPU memory
        let rec_addr = |r: &mlx5::Rec, keep: &Arc<dyn Any + Send + Sync>| match (r.buf(), r.host())
        {
            (Some(b), _) => self.gpu_addr(b, keep.clone()),
            (None, Some(p)) => Ok(map(p, 8, keep)?),
            (None, None) => Err(Error::InvalidArgument("a doorbell record nowhere".into())),
        };
        let keep_scq: Arc<dyn Any + Send + Sync> = scq.clone();
        let keep_rcq: Arc<dyn Any + Send + Sync> = rcq.clone();
        // the doorbell: the UAR page mapped into the GPU, or (CPU proxy) a host word the kernel
        // stores its producer into and a host thread rings for it
        let (uar, proxy_word) = if mode == DoorbellMode::CpuProxy {
            let word = qp
                .proxy_word
                .as_ref()
                .ok_or_else(|| Error::InvalidArgument("an mlx5 QP without a proxy word".into()))?;
            (0, self.map_host(word)?)
        } else {
            (self.map_uar(q, &keep_qp)?, 0)
        };
        let desc = QpDesc {
            sq_ring: self.gpu_addr(&q.sq, keep_qp.clone())?,
            rq_ring: match &q.rq {
                None => 0,
                Some(rq) => self.gpu_addr(rq, keep_qp.clone())?,
            },
            dbrec: rec_addr(&q.dbrec, &keep_qp)?,
            db_reg: uar,
            proxy_word,
            scq_ring: self.gpu_addr(&scq.ring, keep_scq.clone())?,
            scq_dbrec: rec_addr(&scq.dbrec, &keep_scq)?,
            rcq_ring: self.gpu_addr(&rcq.ring, keep_rcq.clone())?,
            rcq_dbrec: rec_addr(&rcq.dbrec, &keep_rcq)?,
            scratch: self.map_host(&scratch)?,
            sq_blocks: q.sq_blocks,
            rq_wqes: q.rq_wqes,
            rq_stride: q.rq_stride,
            qpn: q.qpn,
            scq_ncqe: scq.ncqe,
            rcq_ncqe: rcq.ncqe,
            db_mode: mode.code(),
            // The WQE release before the doorbell: system scope for a host-memory SQ (the
            // provider's rings), GPU scope for one in this GPU's memory (a DEVX QP on it).
            ring_loc: u32::from(!q.sq.is_host()),
            max_inline: q.max_inline,
            scratch_lkey: scratch_mr.lkey().0,
            scq_collapsed: u32::from(scq.mode == verbs::CqMode::Collapsed),
            rcq_collapsed: u32::from(rcq.mode == verbs::CqMode::Collapsed),
            ..QpDesc::new()
        };
        let mut desc = desc;
        let state = QueueState::of_mlx5(qp, q);
        resume_desc(&mut desc, &state)?;
        if let (DoorbellMode::CpuProxy, Some(word)) = (mode, &qp.proxy_word) {
            // the kernel's 64-bit producer continues from the queue's
            word.atomic_u64(0).store(state.sq_pi, Ordering::Release);
        }
        let mem = self.alloc(core::mem::size_of::<QpDesc>())?;
        mem.write(0, bytemuck::bytes_of(&desc))?;
        Ok(ExportedQp {
            mem,
            _keep: Box::new(((scratch, scratch_mr), claim)),
        })
    }
}

/// Sets a new descriptor's device-API counters to continue from `st`: every counter of the
/// SQ at the producer last rung, less the blocks the device has not executed (still in flight,
/// so not retired); the CQ consumer indexes from their doorbell records (a collapsed send CQ:
/// its slot-0 word plus 1, the device API's convention, when a CQE was taken before). The
/// device API counts receive WQEs against receive completions, so the RQ continues only when
/// the receive CQ's consumer index is in step with the RQ (every consumed receive's CQE
/// taken, the receive CQ not shared with the send CQ or another QP), or the RQ was never
/// posted to (it starts fresh); otherwise `Error::InvalidArgument`.
pub(crate) fn resume_desc(d: &mut QpDesc, st: &QueueState) -> Result<(), Error> {
    let pi = st.sq_pi;
    d.sq_reserved = pi;
    d.sq_ready = pi;
    d.sq_rung = pi;
    d.sq_signaled_end = pi;
    d.sq_last_start = pi;
    d.sq_retired = pi.wrapping_sub(u64::from(st.sq_in_flight));
    d.scq_ci = if d.scq_collapsed != 0 {
        match st.scq_slot0 {
            Some(tail) if st.scq_ci != 0 => u64::from(tail) + 1,
            _ => 0,
        }
    } else {
        u64::from(st.scq_ci)
    };
    // An RQ never posted to starts fresh whatever the receive CQ holds (a send CQ shared
    // with it); otherwise its consumer index must be the receive CQ's.
    let rq_out = match st.rq_consumer {
        _ if d.rq_wqes == 0 => 0,
        _ if st.rq_head == 0 && st.rq_consumer.is_none_or(|c| c == 0) => 0,
        Some(c) if c as u16 == st.rcq_ci as u16 => st.rq_head.wrapping_sub(c as u16),
        other => {
            return Err(Error::InvalidArgument(format!(
                "the receive CQ's consumer index ({}) is not in step with the RQ ({}): take \
                 every receive completion before exporting the QP (and give the receives a CQ \
                 of their own)",
                st.rcq_ci,
                match other {
                    Some(c) => format!("{c} receives consumed"),
                    None => "receives consumed unknown: the receive CQ is the send CQ".into(),
                }
            )))
        }
    };
    d.rcq_ci = u64::from(st.rcq_ci);
    d.rq_posted = d.rcq_ci + u64::from(rq_out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_of_another_descriptor_version_are_refused() {
        assert!(check_header(DESC_VERSION).is_ok());
        match check_header(DESC_VERSION.wrapping_add(1)) {
            Err(Error::DescVersion { header, library }) => {
                assert_eq!(
                    (header, library),
                    (DESC_VERSION.wrapping_add(1), DESC_VERSION)
                );
            }
            other => panic!("{other:?}"),
        }
        let msg = check_header(7).unwrap_err().to_string();
        assert!(
            msg.contains("0x00000007") && msg.contains("include_dir"),
            "{msg}"
        );
    }
}
