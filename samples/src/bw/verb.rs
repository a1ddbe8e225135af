//! The operation a bandwidth or latency test measures ([`Verb`], [`AtomicOp`]) and the values of
//! an atomic job ([`atomic_base`], [`atomic_value`]), shared with the latency harness and the
//! kernels.

use crate::AddrFormat;
use clap::ValueEnum;

/// perftest's `-A`: the atomic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AtomicOp {
    /// 8-byte fetch-and-add (perftest's default).
    #[value(name = "FETCH_AND_ADD")]
    FetchAdd,
    /// 8-byte compare-and-swap.
    #[value(name = "CMP_AND_SWAP")]
    CmpSwap,
}

impl AtomicOp {
    /// perftest's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::FetchAdd => "FETCH_AND_ADD",
            Self::CmpSwap => "CMP_AND_SWAP",
        }
    }
}

/// The operation a test measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// RDMA WRITE (`put_bw`, `write_lat`).
    Write,
    /// RDMA READ (`read_bw`, `read_lat`).
    Read,
    /// SEND into posted receives (`send_bw`, `send_lat`).
    Send,
    /// An 8-byte atomic (`atomic_bw`, `atomic_lat`; `-A` chooses which).
    Atomic(AtomicOp),
}

impl Verb {
    /// The verb a binary of `self` runs: an atomic's kind as `-A` chose it.
    pub fn chosen(self, atomic: Option<AtomicOp>) -> Self {
        match (self, atomic) {
            (Self::Atomic(_), Some(op)) => Self::Atomic(op),
            (v, _) => v,
        }
    }

    /// The kernels' code of the verb (`gv_sample_verb_bw`, `gv_sample_verb_lat`).
    pub fn code(self) -> u32 {
        match self {
            Self::Write => 0,
            Self::Read => 1,
            Self::Send => 2,
            Self::Atomic(AtomicOp::FetchAdd) => 3,
            Self::Atomic(AtomicOp::CmpSwap) => 4,
        }
    }

    /// perftest's name of the verb in its titles ("RDMA_Write", "Send", "Atomic FETCH_AND_ADD").
    pub fn title(self) -> String {
        match self {
            Self::Write => "RDMA_Write".into(),
            Self::Read => "RDMA_Read".into(),
            Self::Send => "Send".into(),
            Self::Atomic(op) => format!("Atomic {}", op.name()),
        }
    }

    /// Whether `-o` (outstanding reads / atomics) applies.
    pub fn has_outs(self) -> bool {
        matches!(self, Self::Read | Self::Atomic(_))
    }

    /// Whether `-I` (inline) applies.
    pub fn has_inline(self) -> bool {
        matches!(self, Self::Write | Self::Send)
    }

    /// The format of perftest's address lines for this verb.
    pub fn addr_format(self, outs: u32) -> AddrFormat {
        match self {
            Self::Write => AddrFormat::Rdma,
            Self::Read => AddrFormat::Read { outs },
            Self::Send | Self::Atomic(_) => AddrFormat::Basic,
        }
    }
}

/// The 8-byte word an atomic job starts from (job `j`): all bytes of the results and the word
/// change from one iteration's value to the poison (the complement). `gv_sample_verb_bw` and
/// `gv_sample_verb_lat` compute the same (`samples::atomic_base`).
pub fn atomic_base(j: u64) -> u64 {
    0x0123_4567_0000_0000 ^ ((j + 1) << 40)
}

/// The old value iteration `i` of an atomic job fetches (one poster per QP, in order; add 1 or
/// swap `base + i` for `base + i + 1`), and so the word's value after `i` iterations.
pub fn atomic_value(j: u64, i: u64) -> u64 {
    atomic_base(j).wrapping_add(i)
}
