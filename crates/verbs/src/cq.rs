//! The vocabulary of completion queues every device shares: how a device treats the consumer
//! index, the size of the entries, and what a fresh ring holds.

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
