//! Queue-pair states and the transitions between them.

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
