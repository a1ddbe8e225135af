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
        // the destination MAC of an IPv4-mapped GID on this emulated Ethernet; of a multicast
        // group, the IPv4 multicast MAC (01:00:5e and the group's low 23 bits), as the
        // kernel's `ib_resolve_eth_dmac` gives it
        let g = r.attr.dgid;
        let dmac = if softnic::mcast::group_ipv4(&softnic::Gid(g)).is_some() {
            [0x01, 0x00, 0x5e, g[13] & 0x7f, g[14], g[15]]
        } else {
            [0x02, 0x00, g[12], g[13], g[14], g[15]]
        };
        io.ureply(&abi::Mlx5CreateAhResp {
            response_length: 16,
            dmac,
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
