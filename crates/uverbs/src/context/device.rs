//! The context itself and the device queries: GET_CONTEXT, QUERY_DEVICE, EX_QUERY_DEVICE and
//! QUERY_PORT.

use super::{Context, Created, Io, Uars, BFREGS_PER_UAR, BF_REG_SIZE, MAX_BFREGS};
use crate::abi;
use crate::device::MAX_QP_WR;
use crate::events::EventQueue;
use crate::uaccess::{copy_to_user, Errno};

/// `MLX5_LIB_CAP_DYN_UAR` in the GET_CONTEXT request's `lib_caps`.
const LIB_CAP_DYN_UAR: u64 = 1 << 1;

impl Context {
    /// QUERY_DEVICE.
    pub(super) fn query_device(&self, io: &Io<'_>) -> Result<Created, Errno> {
        io.reply(&self.dev.attr()).map(|_| Created::Nothing)
    }

    pub(super) fn get_context(&self, io: &Io<'_>) -> Result<Created, Errno> {
        if self.soft.lock().is_some() {
            return Err(Errno::EINVAL);
        }
        let req: abi::Mlx5AllocUcontextReq = io.udata()?;
        // MLX5_IB_ALLOC_UCTX_DEVX is the one flag
        if req.flags & !1 != 0 || req.comp_mask != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        let devx = req.flags & 1 != 0;
        // MLX5_LIB_CAP_DYN_UAR: the library allocates its UAR pages itself
        let dynamic = req.lib_caps & LIB_CAP_DYN_UAR != 0 && !self.dev.static_uars();
        let total = req
            .total_num_bfregs
            .max(BFREGS_PER_UAR)
            .checked_next_multiple_of(BFREGS_PER_UAR)
            .ok_or(Errno::EINVAL)?;
        if total > MAX_BFREGS || req.num_low_latency_bfregs > total - 1 {
            return Err(Errno::EINVAL);
        }
        let soft = self.dev.soft()?;
        let uars = if dynamic {
            None
        } else {
            Some(Uars::new((total / BFREGS_PER_UAR) as usize)?)
        };
        let async_q = EventQueue::new(16)?;
        let clock = super::clock::ClockPage::new()?;
        let cqe_version = req.max_cqe_version.min(1);
        let resp = abi::GetContextResp {
            async_fd: async_q.fd() as u32,
            num_comp_vectors: 1,
        };
        io.reply(&resp)?;
        io.ureply(&abi::Mlx5AllocUcontextResp {
            qp_tab_size: 1 << 18,
            bf_reg_size: BF_REG_SIZE,
            // dynamic-UAR mode: no static registers
            tot_bfregs: if dynamic { 0 } else { total },
            cache_line_size: 64,
            // mlx5_ib copies these from the device's `max_wqe_sz_sq` / `max_wqe_sz_rq` (DEVX
            // QUERY_HCA_CAP answers the same): send WQEs of up to 16 basic blocks, as the soft
            // NIC executes them (so a QP may ask for 512 bytes of inline data, as on a
            // ConnectX)
            max_sq_desc_sz: (prm::MAX_WQE_BBS * prm::WQEBB) as u16,
            max_rq_desc_sz: 512,
            max_send_wqebb: MAX_QP_WR,
            max_recv_wr: MAX_QP_WR,
            max_srq_recv_wr: MAX_QP_WR,
            num_ports: 1,
            flow_action_flags: 0,
            comp_mask: 0,
            response_length: std::mem::size_of::<abi::Mlx5AllocUcontextResp>() as u32,
            cqe_version,
            // QUERY_DEVICE and CREATE_AH carry driver data
            cmds_supp_uhw: 0x3,
            eth_min_inline: 0,
            clock_info_versions: 1 << super::clock::V1,
            hca_core_clock_offset: 0,
            log_uar_size: 12,
            num_uars_per_page: 1,
            num_dyn_bfregs: 0,
            dump_fill_mkey: 0,
        })?;
        {
            let mut o = self.objs.lock();
            if !dynamic {
                o.bfreg_use = vec![0; total as usize];
                o.low_latency = req.num_low_latency_bfregs;
            }
            o.devx = devx;
            o.dynamic_uars = dynamic;
        }
        *self.cqe_version.lock() = cqe_version;
        *self.uars.lock() = uars;
        *self.async_q.lock() = Some(async_q);
        *self.clock.lock() = Some(clock);
        *self.soft.lock() = Some(soft);
        Ok(Created::Nothing)
    }

    pub(super) fn ex_query_device(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ExQueryDevice = io.core()?;
        if r.comp_mask != 0 || r.reserved != 0 {
            return Err(Errno::EINVAL);
        }
        let base = self.dev.attr();
        let resp = abi::ExQueryDeviceResp {
            base,
            device_cap_flags_ex: base.device_cap_flags as u64,
            // CQEs carry the soft NIC's free-running clock (a nanosecond tick)
            timestamp_mask: softnic::clock::MASK,
            hca_core_clock: softnic::clock::KHZ,
            response_length: std::mem::size_of::<abi::ExQueryDeviceResp>().min(io.resp.1) as u32,
            max_dm_size: 0,
            ..Default::default()
        };
        let b = bytemuck::bytes_of(&resp);
        let n = b.len().min(io.resp.1);
        if n < std::mem::size_of::<abi::QueryDeviceResp>() + 8 {
            return Err(Errno::ENOSPC);
        }
        copy_to_user(io.resp.0, &b[..n])?;
        io.ureply(&abi::Mlx5QueryDeviceResp {
            comp_mask: 0,
            response_length: 8,
            ..Default::default()
        })?;
        Ok(Created::Nothing)
    }

    pub(super) fn query_port(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::QueryPort = io.core()?;
        if r.port_num != 1 {
            return Err(Errno::EINVAL);
        }
        io.reply(&self.dev.port())?;
        Ok(Created::Nothing)
    }
}
