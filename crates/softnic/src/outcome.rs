//! How a WQE ends: the error it fails with ([`Fail`], with a [`vendor`] syndrome), how it
//! ended when it did not fail ([`Done`]), and how long it must wait to run again ([`Stall`]).
//! Plain values shared by the engine, the responder and the wire transport; no behaviour.

use crate::counters::Counters;
use crate::mem::AccessError;
use prm::Syndrome;
use std::time::{Duration, Instant};

/// Vendor syndromes the soft NIC puts in byte 54 of its error CQEs, so a test (or a person)
/// can tell apart causes that share a syndrome.
pub mod vendor {
    /// The WQE failed the format check (opcode, opmod, ds, inline or atomic length).
    pub const MALFORMED_WQE: u8 = 0x81;
    /// The WQE's control-segment index is not its ring position (stale or half-written WQE:
    /// the initiator published out of order).
    pub const STALE_WQE: u8 = 0x82;
    /// The QPN in the WQE's control segment is not this QP's.
    pub const WQE_QPN: u8 = 0x83;
    /// The QPN in the doorbell value is not this QP's.
    pub const DOORBELL_QPN: u8 = 0x84;
    /// The doorbell producer index is behind the device's consumer index.
    pub const DOORBELL_BEHIND: u8 = 0x85;
    /// The doorbell producer index is more than a ring ahead of the consumer index.
    pub const DOORBELL_AHEAD: u8 = 0x86;
    /// The WQE extends past the producer index, or a BlueFlame WQE past its register.
    pub const WQE_PAST_PRODUCER: u8 = 0x87;
    /// Fault injection.
    pub const INJECTED: u8 = 0x88;
    /// Local key, PD, range or right.
    pub const LOCAL_KEY: u8 = 0x89;
    /// Remote key, PD, range or right (or QP access flags).
    pub const REMOTE_KEY: u8 = 0x8a;
    /// Receive buffer too small, or its key refused.
    pub const RECV_BUFFER: u8 = 0x8b;
    /// No peer answered (absent device or QP, or peer not ready).
    pub const NO_PEER: u8 = 0x8c;
    /// Receiver not ready (no receive WQE posted).
    pub const RNR: u8 = 0x8d;
    /// Misaligned atomic or a WAIT on an unknown CQ.
    pub const INVALID_REQUEST: u8 = 0x8e;
    /// Message longer than the device's maximum.
    pub const TOO_LONG: u8 = 0x8f;
    /// The CQ the completion went to overran.
    pub const CQ_OVERRUN: u8 = 0x90;
    /// A wire response that does not fit its request (opcode or length): BAD_RESP.
    pub const BAD_RESPONSE: u8 = 0x91;
    /// A device-memory (GPU memory) access failed: a payload copy, an atomic, a WQE read from
    /// a GPU-resident ring (the driver's error is logged at warn level).
    pub const DEVICE_MEMORY: u8 = 0x92;
    /// A memory-window bind or invalidation was refused (MW_BIND_ERR), or a SEND_WITH_INV
    /// named a key the responder cannot invalidate.
    pub const MEMORY_WINDOW: u8 = 0x93;
    /// A UMR on an indirect mkey was refused (MW_BIND_ERR: a bad layout, another PD or QP, a
    /// key that is no such mkey), or a SEND_WITH_INV named one not created for remote
    /// invalidation.
    pub const UMR: u8 = 0x94;
    /// A WAIT on a QP created without cross-channel (`cd_master`): LOCAL_QP_OP.
    pub const NOT_CROSS_CHANNEL: u8 = 0x95;
    /// A WAIT whose awaited CQE is an error CQE (the work it waits for failed or was
    /// flushed): WR_FLUSH_ERR, and the WQEs behind it are flushed (a counter never moves).
    pub const WAITED_FOR_ERROR: u8 = 0x96;
}

/// Largest message (bytes), as ConnectX's `max_msg_sz`.
pub const MAX_MSG: u64 = 1 << 30;

/// Why the WQE at the consumer index cannot run yet.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stall {
    /// Retry the WQE at `ci` at this time.
    Until(Instant),
    /// WAIT on a CQ.
    Wait { cqn: u32, max_index: u32 },
    /// Until every WQE handed to the wire has completed (fence, PSN space).
    Drain,
}

/// How a WQE ended when it did not fail.
pub(crate) enum Done {
    /// Completed; the byte count for the CQE.
    Complete(u32),
    /// Must run again later (RNR back-off, transport retry, WAIT).
    Stalled(Stall),
    /// Handed to the wire transport, which completes it when the peer answers.
    Queued,
}

/// A WQE failed: the CQE syndrome and the vendor syndrome.
pub(crate) type Fail = (Syndrome, u8);

/// A local key, PD, range or right check failed: LOCAL_PROT.
pub(crate) fn local_err(_: AccessError) -> Fail {
    (Syndrome::LocalProt, vendor::LOCAL_KEY)
}

/// A device-memory access of the requester's own buffers failed (gather source, READ
/// destination, atomic result): LOCAL_PROT, as a ConnectX reports a local buffer it cannot
/// access, with vendor syndrome [`vendor::DEVICE_MEMORY`].
pub(crate) fn local_devmem_err(c: &Counters, e: &crate::DeviceMemoryError) -> Fail {
    tracing::warn!(error = %e, "device memory failed (requester)");
    Counters::add(&c.devmem_errors, 1);
    (Syndrome::LocalProt, vendor::DEVICE_MEMORY)
}

/// The IBTA RNR NAK timer table (encoding → microseconds).
pub(crate) fn rnr_delay(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[code as usize & 31] as u64)
}
