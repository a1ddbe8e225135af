//! The WQE/CQE formats a user posts and polls with, re-exported from `prm`: what CPU code posts
//! and reads back: work requests in the mlx5 format (the same bytes a kernel writes),
//! completions, keys, the BlueFlame offset of a UAR page, and the CPU initiator that drives a
//! QP's rings ([`Qp::cpu_initiator`](crate::Qp::cpu_initiator)). One set of types for both
//! backends.

pub use prm::cqe::RespKind;
pub use prm::doorbell::{BF_OFFSET, DBR_LESS_OFFSET};
pub use prm::wqe::{AtomicSize, DatagramSeg as AddressVector};
pub use prm::{Completion, CtrlFlags, ErrorCqe, Fence, Lkey, Local, Op, RemoteAddr, Rkey, Sge};
pub use prm::{Opcode, Syndrome};
pub use verbs::initiator::{Initiator as CpuInitiator, InitiatorError, RingMode};
