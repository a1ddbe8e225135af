//! Dynamically connected transport, the initiator's side: each WQE of a DC initiator names
//! its target in an address vector (DCT number, GID, DC access key). An initiator serves one
//! target at a time, as a ConnectX's DCI does: a WQE for another target waits until every
//! message to the current one has been answered, then the initiator moves over (its route,
//! retry state and wire transport start afresh). The target's side is the RC responder
//! ([`crate::responder`]) on a QP of kind [`crate::Transport::Dct`], reached once the key
//! matches ([`crate::engine`]'s route), or on the wire with a responder state per initiator
//! (`wire::dct`).

use crate::outcome::Stall;
use crate::qp::SqState;
use crate::Gid;
use prm::parse::DcAddress;

/// Points the initiator at the target `av` names. `None` when it may go on at once; a stall
/// while messages to the previous target are still unanswered.
pub(crate) fn aim(sq: &mut SqState, av: &DcAddress) -> Option<Stall> {
    let target = (Gid(av.rgid), av.dctn);
    if sq.remote == Some(target) && sq.dc_key == av.key {
        return None;
    }
    if sq.wire.as_ref().is_some_and(|w| !w.msgs.is_empty()) {
        return Some(Stall::Drain);
    }
    sq.remote = Some(target);
    sq.dc_key = av.key;
    sq.dc_generation = sq.dc_generation.wrapping_add(1);
    sq.peer = None;
    sq.wire = None;
    sq.retry_deadline = None;
    sq.rnr_attempts = 0;
    None
}
