//! Exporting a QP into a GPU: its rings, doorbell record, doorbell register (or CPU-proxy word)
//! and CQs mapped into the GPU, and its descriptor ([`QpDesc`], laid out in `desc.rs`) written
//! into GPU memory for kernels to drive (its layout, the contract with the kernels, is
//! [`crate::desc`], at the bottom). This is the job of the module that knows both queues and
//! GPUs; [`crate::gpu`] only maps memory and allocates it.

pub use crate::desc::{c_header, db_mode, QpDesc, DESC_VERSION, HEADER_PATH};

use crate::backend::geometry::{Place, QpGeometry, DB_REG_LEN};
use crate::gpu::{DeviceMem, ExportedQp, Gpu};
use crate::memory::{Access, HostBuffer, Mr};
use crate::queue::{DoorbellMode, Drained, Poster, PosterClaim, Qp, QpState, QueueState};
use crate::Error;
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

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
    /// embedded kernels, `gpuverbs-kernel-build`'s `include_gpuverbs`); for others, see
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

    /// Maps the QP's queues into this GPU and writes its descriptor: one way for every
    /// backend, over the queue geometry the backend made ([`crate::backend::geometry`]).
    fn export_inner(self: &Arc<Self>, qp: &Qp, claim: PosterClaim) -> Result<ExportedQp, Error> {
        let g = qp.geometry();
        let (scq, rcq) = (qp.send_cq().geometry(), qp.recv_cq().geometry());
        if scq.never_overwrites && scq.ncqe < g.sq_blocks {
            // the device API bounds the signaled WQEs in flight by the SQ's size, not the CQ's
            return Err(Error::InvalidArgument(format!(
                "QP {:#x}: its send CQ has {} entries for an SQ of {} blocks; a kernel could \
                 overrun it (make the CQ at least as deep as the SQ)",
                g.qpn, scq.ncqe, g.sq_blocks
            )));
        }
        let mode = qp.doorbell().0;
        let scratch = HostBuffer::new(64);
        let scratch_mr = qp.pd().register_with(&scratch, Access::LOCAL_WRITE)?;
        // the completion-counter table: 16 bytes per SQ block, zeroed (no WQE counted)
        let counters = self.alloc(g.sq_blocks as usize * 16)?;
        let desc = QpDesc {
            sq_ring: self.gpu_addr(g.sq, g.keep.clone())?,
            rq_ring: match g.rq {
                None => 0,
                Some(rq) => self.gpu_addr(rq, g.keep.clone())?,
            },
            dbrec: self.place_addr(&g.dbrec, 8, &g.keep)?,
            // the doorbell: the register mapped into the GPU, or (CPU proxy) a host word the
            // kernel stores its producer into and a host thread rings for it; an emulated
            // no-DBR QP has both (the kernel rings the register, the host thread keeps the
            // record from the word and rings again)
            db_reg: if mode == DoorbellMode::CpuProxy {
                0
            } else {
                self.map_register(&g)?
            },
            proxy_word: match (mode.proxied(), &g.proxy_word) {
                (true, Some(w)) => self.place_addr(w, 8, &g.keep)?,
                (true, None) => {
                    return Err(Error::InvalidArgument(format!(
                        "QP {:#x} has no CPU-proxy word",
                        g.qpn
                    )))
                }
                _ => 0,
            },
            scq_ring: self.gpu_addr(scq.ring, scq.keep.clone())?,
            scq_dbrec: self.place_addr(&scq.dbrec, 8, &scq.keep)?,
            rcq_ring: self.gpu_addr(rcq.ring, rcq.keep.clone())?,
            rcq_dbrec: self.place_addr(&rcq.dbrec, 8, &rcq.keep)?,
            scratch: self.map_host(&scratch)?,
            sq_blocks: g.sq_blocks,
            rq_wqes: g.rq_wqes,
            rq_stride: g.rq_stride,
            qpn: g.qpn,
            scq_ncqe: scq.ncqe,
            rcq_ncqe: rcq.ncqe,
            db_mode: mode.code(),
            // The WQE release before the doorbell: system scope for a host-memory SQ (read by
            // a CPU engine, or by the NIC over PCIe), GPU scope for one in this GPU's memory.
            ring_loc: u32::from(!g.sq.is_host()),
            max_inline: g.max_inline,
            scratch_lkey: scratch_mr.lkey().0,
            scq_collapsed: u32::from(scq.collapsed),
            rcq_collapsed: u32::from(rcq.collapsed),
            sq_counters: counters.ptr(),
            scq_cqn: qp.send_cq().cqn(),
            rcq_cqn: qp.recv_cq().cqn(),
            ..QpDesc::new()
        };
        let mut desc = desc;
        let state = qp.queue_state();
        resume_desc(&mut desc, &state)?;
        if let (true, Some(w)) = (mode.proxied(), &g.proxy_word) {
            // The kernel's 64-bit producer continues from the queue's (a proxy target made
            // now starts there too).
            w.store_u64(state.sq_pi);
        }
        let mem = self.alloc(core::mem::size_of::<QpDesc>())?;
        mem.write(0, bytemuck::bytes_of(&desc))?;
        let keep: Keep = ((scratch, scratch_mr), Some(claim), counters);
        Ok(ExportedQp {
            mem,
            _keep: Box::new(keep),
        })
    }

    /// The GPU address of `len` bytes at `p`: a buffer's mapping (or its own address in this
    /// GPU's memory), or host memory a provider mapped, registered into the GPU.
    fn place_addr(
        &self,
        p: &Place<'_>,
        len: usize,
        keep: &Arc<dyn Any + Send + Sync>,
    ) -> Result<u64, Error> {
        match p {
            Place::Buf(b, off) => Ok(self.gpu_addr(b, keep.clone())? + *off as u64),
            Place::Host(h) => Ok(self.map_range(*h as u64, len, keep.clone(), false)?),
        }
    }

    /// Maps a QP's doorbell register into the GPU: a real UAR as I/O memory first (it is
    /// MMIO), else as plain memory, else an error that says why; a software device's register
    /// as the memory it is.
    fn map_register(&self, g: &QpGeometry<'_>) -> Result<u64, Error> {
        let Place::Host(addr) = g.db_reg else {
            return self.place_addr(&g.db_reg, DB_REG_LEN, &g.keep);
        };
        if !g.db_reg_io {
            return self.place_addr(&g.db_reg, DB_REG_LEN, &g.keep);
        }
        let io_err = match self.map_range(addr as u64, DB_REG_LEN, g.keep.clone(), true) {
            Ok(a) => return Ok(a),
            Err(e) => e,
        };
        match self.map_range(addr as u64, DB_REG_LEN, g.keep.clone(), false) {
            Ok(a) => {
                tracing::info!(qpn = g.qpn, error = %io_err, "UAR page mapped as plain memory");
                Ok(a)
            }
            Err(e) => Err(Error::Unsupported(format!(
                "the GPU cannot map QP {:#x}'s doorbell page: {io_err}; as plain memory: {e} (on \
                 x86 hosts the NVIDIA driver needs NVreg_RegistryDwords=\"PeerMappingOverride=1;\"; \
                 or use the CPU-proxy doorbell mode)",
                g.qpn
            ))),
        }
    }
}

/// What an export keeps alive: its scratch word's buffer and region, the QP's poster claim
/// (given back for the length of [`ExportedQp::recover`]) and the completion-counter table.
type Keep = ((HostBuffer, Mr), Option<PosterClaim>, DeviceMem);

impl ExportedQp {
    /// Brings the QP this descriptor drives back after an error, keeping the descriptor: the
    /// export gives back its poster claim, [`Qp::recover`] drains and resets the QP (waiting
    /// at most `timeout`), the export takes its claim again, and the descriptor's tracking
    /// starts clean ([`ExportedQp::reset_tracking`]). Then the peers exchange endpoints and
    /// [`Qp::connect`] the QP again, and kernels go on with the same descriptor address.
    ///
    /// No kernel may be using the descriptor meanwhile. `qp` must be the exported QP
    /// ([`Error::InvalidArgument`] otherwise) and hold no other poster (a CPU-proxy target
    /// ringing for it: [`Error::PosterBusy`]); [`Qp::recover`]'s conditions apply (rings in
    /// host memory). When the recovery fails the export takes its claim back and the
    /// descriptor is left as it was.
    pub fn recover(&mut self, qp: &Qp, timeout: Duration) -> Result<Drained, Error> {
        self.check_qp(qp)?;
        let keep = self
            ._keep
            .downcast_mut::<Keep>()
            .ok_or_else(|| Error::InvalidArgument("not a QP export".into()))?;
        drop(keep.1.take());
        let drained = qp.recover(timeout);
        keep.1 = Some(qp.posters.claim(Poster::GpuExport)?);
        let drained = drained?;
        self.reset_tracking(qp)?;
        Ok(drained)
    }

    /// Starts the descriptor's tracking clean for a QP in RESET (after [`Qp::recover`], or a
    /// [`Qp::modify`] to RESET once a kernel has drained it): every send-queue counter at the
    /// queue's producer index (0 after a reset), the CQ consumer indexes where the queue's CQs
    /// stand, the recorded error (`sq_error`, `sq_error_info`), the broken
    /// mark, the locks, the checkout word and the completion-counter table (whose entries
    /// name WQE indexes that start again) cleared. The constants (rings, doorbells, sizes,
    /// scratch) stay. No kernel may be using the descriptor meanwhile.
    /// [`Error::InvalidArgument`] when `qp` is not the exported QP or not in RESET.
    pub fn reset_tracking(&self, qp: &Qp) -> Result<(), Error> {
        self.check_qp(qp)?;
        if qp.state() != QpState::Reset {
            return Err(Error::InvalidArgument(format!(
                "QP {:#x} is in {:?}: its tracking starts clean only in RESET (Qp::recover)",
                qp.qpn(),
                qp.state()
            )));
        }
        let mut d = self.read()?;
        resume_desc(&mut d, &qp.queue_state())?;
        d.sq_error = 0;
        d.sq_error_info = 0;
        d.sq_broken = 0;
        d.scq_lock = 0;
        d.rq_lock = 0;
        d.rcq_lock = 0;
        d.checked_out = 0;
        if let (true, Some(w)) = (qp.doorbell().0.proxied(), &qp.geometry().proxy_word) {
            // the kernel's producer continues from the queue's, as at export
            w.store_u64(d.sq_rung);
        }
        if let Some(keep) = self._keep.downcast_ref::<Keep>() {
            keep.2.write(0, &vec![0u8; keep.2.len()])?;
        }
        self.write(&d)?;
        Ok(())
    }

    /// Whether this descriptor drives `qp`.
    fn check_qp(&self, qp: &Qp) -> Result<(), Error> {
        let qpn = self.read()?.qpn;
        if qpn != qp.qpn() {
            return Err(Error::InvalidArgument(format!(
                "the descriptor drives QP {qpn:#x}, not {:#x}",
                qp.qpn()
            )));
        }
        Ok(())
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
    // the send CQ's CQEs so far: every one is taken before an export or a reset (a collapsed
    // CQ's count is not known; the counter calls refuse it)
    d.sq_cqes = d.scq_ci;
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
