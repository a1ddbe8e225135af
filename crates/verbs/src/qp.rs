//! Queue-pair states and the transitions between them, with their attributes.

use crate::{Access, Gid};

/// QP states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QpState {
    /// Fresh or reset.
    Reset = 0,
    /// Initialised: receives may be posted.
    Init = 1,
    /// Ready to receive.
    Rtr = 2,
    /// Ready to send.
    Rts = 3,
    /// Error: every WQE completes with WR_FLUSH.
    Err = 4,
}

impl QpState {
    /// The state a `u8` of [`QpState`]'s representation names (anything past ERR is ERR).
    pub fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::Rtr,
            3 => Self::Rts,
            _ => Self::Err,
        }
    }
}

/// Whether a QP may move from `from` to `to` (IBTA's RC state machine, as far as a verbs
/// user drives it: anything may go to RESET or ERR; RESET or INIT to INIT; INIT to RTR; RTR
/// or RTS to RTS).
pub fn can_move(from: QpState, to: QpState) -> bool {
    use QpState::*;
    matches!(
        (from, to),
        (_, Reset) | (_, Err) | (Reset | Init, Init) | (Init, Rtr) | (Rtr | Rts, Rts)
    )
}

/// Attributes of INIT → RTR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtrAttr {
    /// The peer device's GID.
    pub remote_gid: Gid,
    /// The peer QP number.
    pub remote_qpn: u32,
    /// Expected PSN of the first incoming packet.
    pub rq_psn: u32,
    /// Path MTU in bytes (256..4096).
    pub mtu: u32,
    /// Minimal RNR NAK timer (IBTA encoding, 0..31).
    pub min_rnr_timer: u8,
    /// Selective repeat on the wire, which both ends must have agreed on (gpuverbs endpoints
    /// of soft NICs advertise it): the responder holds packets that arrive behind a gap and
    /// the requester resends only the packet a sequence NAK names (as ConnectX's selective
    /// retransmission), instead of going back N. Off (go-back-N, the IBTA default) for peers
    /// that did not advertise it, and for every QP set up through the uverbs emulation.
    pub selective_repeat: bool,
}

/// Attributes of RTR → RTS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttr {
    /// First PSN sent.
    pub sq_psn: u32,
    /// Local ACK timeout (4.096 µs · 2^timeout; 0 = infinite).
    pub timeout: u8,
    /// Transport retries (0..7).
    pub retry_cnt: u8,
    /// RNR retries (0..7; 7 = infinite).
    pub rnr_retry: u8,
}

impl Default for RtsAttr {
    fn default() -> Self {
        Self {
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
        }
    }
}

/// A state transition with its attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Modify {
    /// RESET → INIT (or INIT → INIT): the remote rights peers get through this QP.
    Init {
        /// Remote access rights (REMOTE_WRITE/READ/ATOMIC).
        access: Access,
    },
    /// INIT → RTR.
    Rtr(RtrAttr),
    /// RTR → RTS (or RTS → RTS). A UD QP takes `sq_psn` (its first packet's PSN) and
    /// ignores the rest.
    Rts(RtsAttr),
    /// UD: RESET → INIT (or INIT → INIT), with the QP's Q_Key (P_Key index 0, port 1).
    InitUd {
        /// Q_Key: incoming datagrams must carry it; sent when a WQE's Q_Key has its high bit set.
        qkey: u32,
    },
    /// UD: INIT → RTR (no peer, no path).
    RtrUd,
    /// DC initiator or target: INIT → RTR. No peer: an initiator names its target in each
    /// WQE; a target takes any initiator that presents its key.
    RtrDc {
        /// Path MTU in bytes (256..4096).
        mtu: u32,
        /// A target's RNR NAK timer code (0..31).
        min_rnr_timer: u8,
    },
    /// any → ERR.
    Err,
    /// any → RESET.
    Reset,
}
