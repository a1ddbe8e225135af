//! The fixture of the error tests (`errors.rs`, `errors_peer.rs`): a connected pair, a
//! gather source, a target with every right and a result buffer, and the check that a
//! failing WQE completes with its error CQE, flushes what follows and writes nothing.
#![allow(dead_code)]

use crate::common::*;
use prm::wqe::{Local, Op};
use prm::Syndrome;
use softnic::Access;

pub const ALL_REMOTE: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// A pair, a gather source on A (filled with 0x11), a 4 KiB target on B (zeros, every
/// right) and a result buffer on A.
pub struct Fx {
    pub p: Pair,
    pub src: Buf,
    pub dst: Buf,
    pub res: Buf,
}

impl Fx {
    pub fn new() -> Self {
        Self::with(Opts::default(), Opts::default())
    }
    pub fn with(oa: Opts, ob: Opts) -> Self {
        let p = Pair::with(oa, ob);
        let src = p.a.buf(4096, Access::NONE);
        src.fill(0x11);
        let dst = p.b.buf(4096, ALL_REMOTE);
        let res = p.a.buf(64, Access::LOCAL_WRITE);
        Self { p, src, dst, res }
    }
    /// A good signaled WRITE first, so error CQEs carry a non-zero wqe_counter.
    pub fn warm_up(&mut self) {
        let op = Op::Write {
            remote: self.dst.remote(0),
            local: Local::Sges(&[self.src.sge(0, 8)]),
            imm: None,
        };
        let idx = self.p.ea.go(&op, SIG);
        self.p.ea.expect_req(0x08, idx);
        self.dst.fill(0);
    }
    /// Posts `op` unsignaled followed (same doorbell) by a signaled WRITE and an unsignaled
    /// NOP; expects the error CQE for `op` and one flush for each of the other two; then
    /// more flushes; checks that B's memory is untouched and A's QP is in ERR.
    pub fn fails(&mut self, op: &Op<'_>, syndrome: Syndrome, why: u8) -> u16 {
        self.warm_up();
        let opcode = op.opcode().0 as u8;
        let idx = self.p.ea.post(op, UNSIG);
        let after = self.trailers();
        self.p.ea.ini.ring();
        self.p.ea.expect_err(syndrome, why, opcode, idx);
        for (opc, i) in after {
            self.p.ea.expect_flush(opc, i);
        }
        self.p.ea.expect_flushes_after(3);
        self.untouched();
        idx
    }
    /// Two WQEs behind the failing one, in the same doorbell batch.
    pub fn trailers(&mut self) -> Vec<(u8, u16)> {
        let w = Op::Write {
            remote: self.dst.remote(100),
            local: Local::Sges(&[self.src.sge(0, 64)]),
            imm: None,
        };
        let a = self.p.ea.post(&w, SIG);
        let b = self.p.ea.post(&Op::Nop, UNSIG);
        vec![(0x08, a), (0x00, b)]
    }
    pub fn untouched(&self) {
        assert!(self.dst.bytes().iter().all(|&b| b == 0), "target written");
        assert!(self.dst.guards_intact() && self.src.guards_intact());
        assert!(self.res.guards_intact());
    }
}

pub fn bad_key() -> u32 {
    0x00de_ad00
}
