//! The reference model of the differential test: plain `Vec<u8>` memories, the regions of
//! both sides, and what each WQE of the stream does to them and which CQEs it gives (the first
//! error moves the QP to ERR, every later WQE flushes).

use super::*;

/// A memory region as the model sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct MMr {
    pub(super) key: u32,
    pub(super) pd: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) access: u32,
    pub(super) mem: usize,
}

/// One CQE reduced to what both sides must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct K {
    /// CQE opcode: 0 REQ, 1 RESP_WR_IMM, 2 RESP_SEND, 3 RESP_SEND_IMM, 13 REQ_ERR, 14 RESP_ERR.
    pub(super) op: u8,
    pub(super) syndrome: u8,
    pub(super) counter: u16,
    /// WQE opcode (requester CQEs).
    pub(super) wqe_opcode: u8,
    /// Byte count where meaningful (READ, atomics, responder).
    pub(super) bytes: u32,
    pub(super) imm: Option<u32>,
}

pub(super) struct Model {
    pub(super) mems: Vec<Vec<u8>>,
    pub(super) a_mrs: Vec<MMr>,
    pub(super) b_mrs: Vec<MMr>,
    pub(super) a_pd: u32,
    pub(super) b_pd: u32,
    // episode state
    pub(super) b_access: u32,
    pub(super) a_err: bool,
    pub(super) b_err: bool,
    pub(super) recvs: VecDeque<(u16, Vec<Sge>)>,
    pub(super) req: Vec<K>,
    pub(super) resp: Vec<K>,
}

pub(super) type Fail = Syndrome;

impl Model {
    /// Finds `addr..addr+len` in region `key` of PD `pd` with rights `need`.
    pub(super) fn find(
        mrs: &[MMr],
        pd: u32,
        need: u32,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Option<(usize, usize)> {
        let mr = mrs.iter().find(|m| m.key == key)?;
        let end = addr.checked_add(len)?;
        (mr.pd == pd && addr >= mr.addr && end <= mr.addr + mr.len && mr.access & need == need)
            .then(|| (mr.mem, (addr - mr.addr) as usize))
    }

    pub(super) fn sge_len(s: &Sge) -> u64 {
        if s.len == 0 {
            0x8000_0000 // a zero byte count means 2 GiB
        } else {
            s.len as u64
        }
    }

    /// Bytes of a WRITE/SEND source, or the local error.
    pub(super) fn gather(&self, l: &L) -> Result<Vec<u8>, Fail> {
        match l {
            L::Inline(b) if b.len() as u32 > MAX_INLINE => Err(Syndrome::LocalLength),
            L::Inline(b) => Ok(b.clone()),
            L::Sges(list) => {
                let mut out = Vec::new();
                let mut places = Vec::new();
                for s in list {
                    let len = Self::sge_len(s);
                    let at = Self::find(&self.a_mrs, self.a_pd, 0, s.lkey.0, s.addr, len)
                        .ok_or(Syndrome::LocalProt)?;
                    places.push((at, len as usize));
                }
                for ((m, o), n) in places {
                    out.extend_from_slice(&self.mems[m][o..o + n]);
                }
                Ok(out)
            }
        }
    }

    pub(super) fn remote(
        &self,
        need: Access,
        r: RemoteAddr,
        len: u64,
    ) -> Result<(usize, usize), Fail> {
        if self.b_access & need.0 != need.0 {
            return Err(Syndrome::RemoteAccess);
        }
        if len == 0 {
            // IBTA C9-88: no key or address check for zero bytes (nothing is touched)
            return Ok((0, 0));
        }
        Self::find(&self.b_mrs, self.b_pd, need.0, r.rkey.0, r.addr, len)
            .ok_or(Syndrome::RemoteAccess)
    }

    pub(super) fn resp_ok(&mut self, op: u8, counter: u16, bytes: usize, imm: Option<u32>) {
        self.resp.push(K {
            op,
            syndrome: 0,
            counter,
            wqe_opcode: 0,
            bytes: bytes as u32,
            imm,
        });
    }

    pub(super) fn resp_err(&mut self, syndrome: Syndrome, counter: u16) {
        self.resp.push(K {
            op: 14,
            syndrome: syndrome as u8,
            counter,
            wqe_opcode: 0,
            bytes: 0,
            imm: None,
        });
    }

    /// The responder fails: it goes to ERR and its posted receives flush.
    pub(super) fn b_fails(&mut self) {
        self.b_err = true;
        while let Some((i, _)) = self.recvs.pop_front() {
            self.resp_err(Syndrome::WrFlush, i);
        }
    }

    /// Runs one WQE at index `idx`; appends the CQEs it produces.
    pub(super) fn run(&mut self, g: &G, idx: u16, signaled: bool) {
        let wqe_opcode = g.opcode_byte();
        if self.a_err {
            self.req.push(K {
                op: 13,
                syndrome: Syndrome::WrFlush as u8,
                counter: idx,
                wqe_opcode,
                bytes: 0,
                imm: None,
            });
            return;
        }
        match self.exec(g) {
            Ok(bytes) => {
                if signaled {
                    let meaningful = matches!(g, G::Read { .. } | G::Atomic { .. });
                    let bytes = if meaningful { bytes } else { 0 };
                    self.req.push(K {
                        op: 0,
                        syndrome: 0,
                        counter: idx,
                        wqe_opcode,
                        bytes,
                        imm: None,
                    });
                }
            }
            Err(s) => {
                self.a_err = true;
                self.req.push(K {
                    op: 13,
                    syndrome: s as u8,
                    counter: idx,
                    wqe_opcode,
                    bytes: 0,
                    imm: None,
                });
            }
        }
    }

    pub(super) fn exec(&mut self, g: &G) -> Result<u32, Fail> {
        match g {
            G::Nop => Ok(0),
            G::Raw(Raw::InlineCount) => Err(Syndrome::LocalLength),
            G::Raw(_) => Err(Syndrome::LocalQpOp),
            G::Write { remote, local, imm } => {
                let src = self.gather(local)?;
                assert!(
                    imm.is_none() || !self.recvs.is_empty(),
                    "generator: WRITE_IMM without a receive"
                );
                let (m, o) = match self.remote(Access::REMOTE_WRITE, *remote, src.len() as u64) {
                    Ok(x) => x,
                    Err(s) => {
                        self.b_fails();
                        return Err(s);
                    }
                };
                self.mems[m][o..o + src.len()].copy_from_slice(&src);
                if let Some(imm) = imm {
                    let (i, _) = self.recvs.pop_front().unwrap();
                    self.resp_ok(1, i, src.len(), Some(*imm));
                }
                Ok(src.len() as u32)
            }
            G::Send { local, imm } => {
                let src = self.gather(local)?;
                let (i, sges) = self
                    .recvs
                    .front()
                    .cloned()
                    .expect("generator: SEND without a receive");
                let mut places = Vec::new();
                for s in &sges {
                    let len = Self::sge_len(s);
                    match Self::find(
                        &self.b_mrs,
                        self.b_pd,
                        Access::LOCAL_WRITE.0,
                        s.lkey.0,
                        s.addr,
                        len,
                    ) {
                        Some(at) => places.push((at, len as usize)),
                        None => {
                            self.recvs.pop_front();
                            self.resp_err(Syndrome::LocalProt, i);
                            self.b_fails();
                            return Err(Syndrome::RemoteOp);
                        }
                    }
                }
                if places.iter().map(|p| p.1).sum::<usize>() < src.len() {
                    self.recvs.pop_front();
                    self.resp_err(Syndrome::LocalLength, i);
                    self.b_fails();
                    return Err(Syndrome::RemoteInvalReq);
                }
                self.recvs.pop_front();
                let mut at = 0;
                for ((m, o), n) in places {
                    let k = n.min(src.len() - at);
                    self.mems[m][o..o + k].copy_from_slice(&src[at..at + k]);
                    at += k;
                }
                self.resp_ok(if imm.is_some() { 3 } else { 2 }, i, src.len(), *imm);
                Ok(src.len() as u32)
            }
            G::Read { remote, sges } => {
                let mut places = Vec::new();
                for s in sges {
                    let len = Self::sge_len(s);
                    let at = Self::find(
                        &self.a_mrs,
                        self.a_pd,
                        Access::LOCAL_WRITE.0,
                        s.lkey.0,
                        s.addr,
                        len,
                    )
                    .ok_or(Syndrome::LocalProt)?;
                    places.push((at, len as usize));
                }
                let total: usize = places.iter().map(|p| p.1).sum();
                let (m, o) = match self.remote(Access::REMOTE_READ, *remote, total as u64) {
                    Ok(x) => x,
                    Err(s) => {
                        self.b_fails();
                        return Err(s);
                    }
                };
                let data = self.mems[m][o..o + total].to_vec();
                let mut at = 0;
                for ((m, o), n) in places {
                    self.mems[m][o..o + n].copy_from_slice(&data[at..at + n]);
                    at += n;
                }
                Ok(total as u32)
            }
            G::Atomic { remote, at, result } => {
                let size = at.size();
                if result.len != size {
                    return Err(Syndrome::LocalLength); // format check, before any key
                }
                let res = Self::find(
                    &self.a_mrs,
                    self.a_pd,
                    Access::LOCAL_WRITE.0,
                    result.lkey.0,
                    result.addr,
                    size as u64,
                )
                .ok_or(Syndrome::LocalProt)?;
                if remote.addr % size as u64 != 0 {
                    self.b_fails();
                    return Err(Syndrome::RemoteInvalReq);
                }
                let (m, o) = match self.remote(Access::REMOTE_ATOMIC, *remote, size as u64) {
                    Ok(x) => x,
                    Err(s) => {
                        self.b_fails();
                        return Err(s);
                    }
                };
                let n = size as usize;
                let mut raw = [0u8; 8];
                raw[..n].copy_from_slice(&self.mems[m][o..o + n]);
                let old = if n == 8 {
                    u64::from_ne_bytes(raw)
                } else {
                    u32::from_ne_bytes(raw[..4].try_into().unwrap()) as u64
                };
                let t = |x: u64| if n == 4 { x & 0xffff_ffff } else { x };
                let new = match *at {
                    At::Fa { add } => old.wrapping_add(add),
                    At::Cs { compare, swap } => {
                        if old == compare {
                            swap
                        } else {
                            old
                        }
                    }
                    At::MFa { add, boundary, .. } => {
                        model_field_add(old, t(add), t(boundary), 8 * size)
                    }
                    At::MCs {
                        compare,
                        cmask,
                        swap,
                        smask,
                        ..
                    } => {
                        let (c, cm, s, sm) = (t(compare), t(cmask), t(swap), t(smask));
                        if old & cm == c & cm {
                            (old & !sm) | (s & sm)
                        } else {
                            old
                        }
                    }
                };
                let nb = new.to_ne_bytes();
                let ob = old.to_ne_bytes();
                // a 4-byte original value lands big-endian in the result (as a ConnectX
                // writes it); targets hold host-endian values
                let (nb, ob) = if n == 8 {
                    (&nb[..], &ob[..])
                } else {
                    (
                        &(new as u32).to_ne_bytes()[..],
                        &(old as u32).to_be_bytes()[..],
                    )
                };
                self.mems[m][o..o + n].copy_from_slice(nb);
                let (rm, ro) = res;
                self.mems[rm][ro..ro + n].copy_from_slice(ob);
                Ok(size)
            }
        }
    }
}
