//! Protection domains and memory regions: keys, ranges and access rights, checked on every
//! access exactly where a ConnectX checks them.
//!
//! An mkey is `index << 8 | tag`; lkey and rkey are the same value (as on mlx5). The tag changes
//! each time an index is reused, so a stale key from a deregistered region is a bad key, not a
//! silent hit on whatever took its slot.

use parking_lot::{RwLock, RwLockReadGuard};

/// Access rights of a memory region (ibverbs bit values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Access(pub u32);

impl Access {
    /// No remote rights, no local write.
    pub const NONE: Access = Access(0);
    /// The device may write the region on behalf of local WQEs (RDMA_READ targets, receives,
    /// atomic results).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may RDMA_WRITE into the region.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may RDMA_READ from the region.
    pub const REMOTE_READ: Access = Access(4);
    /// Peers may run atomics on the region.
    pub const REMOTE_ATOMIC: Access = Access(8);

    /// Whether every right in `other` is present.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

/// A protection domain number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PdId(pub u32);

/// Why an access to registered memory was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// No region has this key.
    #[error("no memory region with key {0:#x}")]
    BadKey(u32),
    /// The region belongs to another protection domain.
    #[error("key {0:#x} belongs to another protection domain")]
    WrongPd(u32),
    /// The range is not inside the region.
    #[error("range {addr:#x}+{len} outside region of key {key:#x}")]
    OutOfRange {
        /// Key.
        key: u32,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The region lacks a right the access needs.
    #[error("key {key:#x} lacks access {need:?}")]
    MissingRight {
        /// Key.
        key: u32,
        /// Rights required.
        need: Access,
    },
}

/// Where a region's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Host memory the engine can address directly.
    Host,
}

/// A registered region as the device records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrInfo {
    /// lkey = rkey.
    pub key: u32,
    /// Owning PD.
    pub pd: PdId,
    /// First byte (virtual address).
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Rights.
    pub access: Access,
    /// Where it lives.
    pub kind: MemKind,
}

impl MrInfo {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

#[derive(Default)]
struct Slot {
    tag: u8,
    mr: Option<MrInfo>,
}

/// The device's table of memory regions.
#[derive(Default)]
pub struct MrTable {
    slots: RwLock<Vec<Slot>>,
}

/// A checked host range `addr..addr+len` inside a live region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRange {
    /// First byte.
    pub addr: u64,
    /// Length.
    pub len: u64,
}

impl MrTable {
    /// Records a region and returns its description with its key.
    pub fn insert(&self, pd: PdId, addr: u64, len: u64, access: Access, kind: MemKind) -> MrInfo {
        let mut slots = self.slots.write();
        let index = slots
            .iter()
            .position(|s| s.mr.is_none())
            .unwrap_or_else(|| {
                slots.push(Slot::default());
                slots.len() - 1
            });
        let slot = &mut slots[index];
        slot.tag = slot.tag.wrapping_add(1);
        let info = MrInfo {
            key: (index as u32) << 8 | slot.tag as u32,
            pd,
            addr,
            len,
            access,
            kind,
        };
        slot.mr = Some(info);
        info
    }

    /// Removes a region; `None` when the key is not live. Copies hold a [`MrGuard`] for their
    /// whole duration, so removal waits for copies in flight and memory is never freed under
    /// the device.
    pub fn remove(&self, key: u32) -> Option<MrInfo> {
        let mut slots = self.slots.write();
        match slots.get_mut((key >> 8) as usize) {
            Some(s) if s.mr.is_some_and(|m| m.key == key) => s.mr.take(),
            _ => None,
        }
    }

    /// Looks a region up by key.
    pub fn get(&self, key: u32) -> Option<MrInfo> {
        self.read().lookup(key)
    }

    /// Holds the table for checks and copies; regions cannot be removed meanwhile. Guards of
    /// several tables may be held at once in any order (recursive reads never wait for writers).
    pub fn read(&self) -> MrGuard<'_> {
        MrGuard(self.slots.read_recursive())
    }
}

/// A read hold on an [`MrTable`].
pub struct MrGuard<'a>(RwLockReadGuard<'a, Vec<Slot>>);

impl MrGuard<'_> {
    fn lookup(&self, key: u32) -> Option<MrInfo> {
        self.0
            .get((key >> 8) as usize)
            .and_then(|s| s.mr)
            .filter(|m| m.key == key)
    }

    /// Checks that `addr..addr+len` lies in the region of `key`, in `pd`, with rights `need`.
    pub fn check(
        &self,
        pd: PdId,
        need: Access,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Result<HostRange, AccessError> {
        let mr = self.lookup(key).ok_or(AccessError::BadKey(key))?;
        if mr.pd != pd {
            return Err(AccessError::WrongPd(key));
        }
        if !mr.covers(addr, len) {
            return Err(AccessError::OutOfRange { key, addr, len });
        }
        if !mr.access.contains(need) {
            return Err(AccessError::MissingRight { key, need });
        }
        Ok(HostRange { addr, len })
    }
}

/// Copies bytes from `src` ranges to `dst` ranges (total lengths may differ; copies the
/// shorter total). Returns bytes copied.
///
/// # Safety
/// Every range must be live host memory: checked by an [`MrGuard`] still held by the caller,
/// or a buffer the caller owns.
pub unsafe fn copy_ranges(dst: &[HostRange], src: &[HostRange]) -> u64 {
    let (mut di, mut doff, mut si, mut soff, mut total) = (0, 0u64, 0, 0u64, 0u64);
    while di < dst.len() && si < src.len() {
        let d = dst[di];
        let s = src[si];
        let n = (d.len - doff).min(s.len - soff);
        if n > 0 {
            // SAFETY: both ranges are live host memory per the caller's contract, and n stays
            // within each; `copy` tolerates overlap (a region written into itself).
            unsafe {
                std::ptr::copy(
                    (s.addr + soff) as *const u8,
                    (d.addr + doff) as *mut u8,
                    n as usize,
                )
            };
        }
        total += n;
        doff += n;
        soff += n;
        if doff == d.len {
            di += 1;
            doff = 0;
        }
        if soff == s.len {
            si += 1;
            soff = 0;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_ranges_rights_and_stale_keys() {
        let t = MrTable::default();
        let pd = PdId(1);
        let a = t.insert(
            pd,
            0x1000,
            0x100,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            MemKind::Host,
        );
        let g = t.read();
        assert_eq!(
            g.check(pd, Access::REMOTE_WRITE, a.key, 0x1080, 0x80),
            Ok(HostRange {
                addr: 0x1080,
                len: 0x80
            })
        );
        assert_eq!(
            g.check(pd, Access::REMOTE_WRITE, a.key, 0x1080, 0x81),
            Err(AccessError::OutOfRange {
                key: a.key,
                addr: 0x1080,
                len: 0x81
            })
        );
        assert_eq!(
            g.check(pd, Access::REMOTE_READ, a.key, 0x1000, 1),
            Err(AccessError::MissingRight {
                key: a.key,
                need: Access::REMOTE_READ
            })
        );
        assert_eq!(
            g.check(PdId(2), Access::NONE, a.key, 0x1000, 1),
            Err(AccessError::WrongPd(a.key))
        );
        drop(g);
        assert!(t.remove(a.key).is_some());
        assert!(t.remove(a.key).is_none());
        let b = t.insert(pd, 0x1000, 0x100, Access::NONE, MemKind::Host);
        assert_ne!(a.key, b.key, "reused slot gets a new tag");
        assert_eq!(
            t.read().check(pd, Access::NONE, a.key, 0x1000, 1),
            Err(AccessError::BadKey(a.key))
        );
    }

    #[test]
    fn scatter_gather_copy() {
        let src = *b"abcdefghij";
        let mut dst = [0u8; 10];
        let s = [
            HostRange {
                addr: src.as_ptr() as u64,
                len: 3,
            },
            HostRange {
                addr: src.as_ptr() as u64 + 3,
                len: 7,
            },
        ];
        let d = [
            HostRange {
                addr: dst.as_mut_ptr() as u64,
                len: 5,
            },
            HostRange {
                addr: dst.as_mut_ptr() as u64 + 5,
                len: 5,
            },
        ];
        // SAFETY: the ranges are the two local arrays.
        let n = unsafe { copy_ranges(&d, &s) };
        assert_eq!((n, &dst), (10, b"abcdefghij"));
    }
}
