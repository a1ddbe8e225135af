//! The vocabulary of completion queues every device shares: how a device treats the consumer
//! index, the size of the entries, and what a fresh ring holds.

use crate::{DeviceMemoryError, DmaBuf};
use prm::cqe::{Cqe64, OP_OWN_INVALID, OP_OWN_INVALID_OWNED};
use prm::CQE_SIZE;

/// How the device treats the consumer index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqMode {
    /// The device never reads the consumer index (what GPU stacks use).
    #[default]
    OverrunIgnore,
    /// The device reads the consumer index from the CQ doorbell record; a CQE that would
    /// overwrite an entry not yet consumed puts the CQ in error (CQ overrun).
    OverrunDetect,
    /// Every CQE lands in slot 0 (the newest completion overwrites the last).
    Collapsed,
}

/// The size of a CQ's entries (the CQ context's `cqe_sz`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqeSize {
    /// 64-byte entries: the CQE is the entry (`cqe_sz` 0).
    #[default]
    B64,
    /// 128-byte entries (`cqe_sz` 1): the 64-byte CQE is the entry's second half.
    B128,
}

impl CqeSize {
    /// The entry size in bytes (the ring's stride).
    pub const fn bytes(self) -> usize {
        match self {
            Self::B64 => 64,
            Self::B128 => 128,
        }
    }
    /// Where the 64-byte CQE lies in its entry.
    pub const fn cqe_offset(self) -> usize {
        self.bytes() - CQE_SIZE
    }
    /// The size for an entry of `bytes` bytes (64 or 128).
    pub const fn from_bytes(bytes: u32) -> Option<Self> {
        match bytes {
            64 => Some(Self::B64),
            128 => Some(Self::B128),
            _ => None,
        }
    }
}

/// The byte a fresh ring is filled with at `op_own`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqInit {
    /// `0xF0`, as the mlx5 provider initialises.
    #[default]
    Invalid,
    /// `0xF1`, as DOCA pre-fills.
    InvalidOwned,
    /// Left as the consumer wrote it: a ConnectX writes a CQ ring only with CQEs, and a CQ
    /// created with a PRM command (DEVX) lives in memory its owner prepared.
    Untouched,
}

/// Prepares the first `ncqe` entries of a CQ ring of 64-byte CQEs as `init` says: an invalid
/// CQE with the `op_own` it names in each (host or device memory), or nothing for
/// [`CqInit::Untouched`].
pub fn prefill(ring: &DmaBuf, ncqe: usize, init: CqInit) -> Result<(), DeviceMemoryError> {
    prefill_sized(ring, ncqe, init, CqeSize::B64)
}

/// [`prefill`] for entries of `size`: with 128-byte entries the invalid CQE is written into
/// each entry's second half (where the CQE lies) and the first half is zeroed.
pub fn prefill_sized(
    ring: &DmaBuf,
    ncqe: usize,
    init: CqInit,
    size: CqeSize,
) -> Result<(), DeviceMemoryError> {
    let fill = match init {
        CqInit::Invalid => OP_OWN_INVALID,
        CqInit::InvalidOwned => OP_OWN_INVALID_OWNED,
        CqInit::Untouched => return Ok(()),
    };
    let stride = size.bytes();
    let bytes = ncqe * stride;
    if ring.len() < bytes {
        return Err(DeviceMemoryError(format!(
            "a CQ ring of {} bytes is smaller than {ncqe} entries of {stride}",
            ring.len()
        )));
    }
    let mut entry = vec![0u8; stride];
    entry[size.cqe_offset()..].copy_from_slice(bytemuck::bytes_of(&Cqe64::invalid(fill)));
    if ring.is_host() {
        for i in 0..ncqe {
            ring.write(i * stride, &entry);
        }
    } else {
        // device memory: as few writes as the bounce size allows (one for rings ≤ 1 MiB)
        let chunk = bytes.min(crate::devmem::BOUNCE);
        let mut fill = Vec::with_capacity(chunk);
        while fill.len() < chunk {
            fill.extend_from_slice(&entry);
        }
        for off in (0..bytes).step_by(chunk) {
            ring.try_write(off, &fill[..chunk.min(bytes - off)])?;
        }
    }
    Ok(())
}
