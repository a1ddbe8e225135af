//! Access rights of a memory region, with ibverbs' bit values, and where its bytes live.

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
    /// Memory windows may be bound to the region (`IBV_ACCESS_MW_BIND`).
    pub const MW_BIND: Access = Access(16);
    /// The rights a remote peer may use through a key (write, read, atomics).
    pub const REMOTE: Access = Access(2 | 4 | 8);

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

/// Where a region's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Host memory the engine can address directly.
    Host,
    /// Device (GPU) memory, reached through the [`DeviceMemory`](crate::DeviceMemory) given at registration.
    Device,
}
