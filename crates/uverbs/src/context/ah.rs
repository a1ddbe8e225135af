//! Address handles: CREATE_AH and DESTROY_AH.

use super::{Context, Created, Io};
use crate::abi;
use crate::uaccess::Errno;

pub(super) struct AhObj {
    pub(super) pd: u32,
}

impl Context {
    pub(super) fn create_ah(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::CreateAh = io.core()?;
        let mut o = self.objs.lock();
        if !o.pds.contains_key(&r.pd_handle) {
            return Err(Errno::EINVAL);
        }
        if r.attr.port_num != 1 || r.attr.is_global == 0 || r.attr.sgid_index != 0 {
            return Err(Errno::EINVAL);
        }
        let h = o.handle();
        io.reply(&abi::CreateAhResp { ah_handle: h })?;
        // the destination MAC of an IPv4-mapped GID on this emulated Ethernet
        let g = r.attr.dgid;
        io.ureply(&abi::Mlx5CreateAhResp {
            response_length: 16,
            dmac: [0x02, 0x00, g[12], g[13], g[14], g[15]],
            reserved: [0; 6],
        })?;
        o.ahs.insert(h, AhObj { pd: r.pd_handle });
        Ok(Created::Nothing)
    }

    pub(super) fn destroy_ah(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        self.objs
            .lock()
            .ahs
            .remove(&r.handle)
            .ok_or(Errno::EINVAL)?;
        Ok(Created::Nothing)
    }
}
