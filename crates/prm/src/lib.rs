//! mlx5 data-path formats: the bytes a ConnectX reads from a send queue and writes into a
//! completion queue, and the doorbell words that connect the two.
//!
//! Everything here is `#[repr(C)]`, [`bytemuck::Pod`], alignment 1 and big-endian where the
//! hardware is big-endian, through the newtypes of [`endian`]. Keys have their own big-endian
//! types ([`BeLkey`], [`BeRkey`]), so a key stored in the wrong byte order, or an lkey where an rkey
//! belongs, does not type-check.
//!
//! Layout: [`endian`] (byte order) → [`wqe`] (segments, opcodes, typed builders) →
//! [`parse`] (raw WQE bytes → typed operation or typed error) → [`cqe`] (64-byte CQE, syndromes)
//! → [`doorbell`] (doorbell records, UAR/BlueFlame offsets, doorbell values).
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(test)]
extern crate std;

pub mod cmd;
pub mod cqe;
pub mod doorbell;
pub mod endian;
pub mod parse;
pub mod wqe;

pub use cqe::{Completion, Cqe64, CqeOpcode, ErrorCqe, Syndrome};
pub use endian::{Be16, Be32, Be64, BeLkey, BeRkey, Lkey, Rkey};
pub use parse::{parse_wqe, ParsedOp, ParsedWqe, WqeError};
pub use wqe::{BuildError, CtrlFlags, Fence, Local, Op, Opcode, RemoteAddr, Sge, WqeBuf};

/// Size of a send-queue basic block (WQEBB) in bytes.
pub const WQEBB: usize = 64;
/// Size of one WQE unit counted by `ds` (bytes).
pub const DS_UNIT: usize = 16;
/// Largest `ds` the 6-bit field can carry.
pub const MAX_DS: u8 = 63;
/// Largest WQE in basic blocks (`ceil(63 / 4)`).
pub const MAX_WQE_BBS: usize = 16;
/// Size of a CQE in bytes.
pub const CQE_SIZE: usize = 64;
