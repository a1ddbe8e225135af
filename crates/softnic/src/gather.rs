//! A WQE's local data as checked ranges: the gather list of a WRITE or SEND (pointer
//! segments, inline bytes of the WQE copy, or both in WQE order) and the scatter list of a
//! READ, each key checked (through an indirect mkey, piece by piece) before anything moves.

use crate::mem::{total, Access, MemRange, MrGuard};
use crate::outcome::{local_err, vendor, Fail, MAX_MSG};
use crate::qp::Qp;
use prm::parse::{sge_of, LocalSeg, ParsedLocal};
use prm::wqe::DataSeg;
use prm::Syndrome;
use smallvec::SmallVec;

/// Checked local ranges of a gather/scatter list.
pub(crate) fn local_ranges(
    g: &MrGuard<'_>,
    qp: &Qp,
    need: Access,
    list: &[DataSeg],
) -> Result<SmallVec<[MemRange; 4]>, Fail> {
    let mut out = SmallVec::new();
    for d in list {
        let s = sge_of(d);
        g.resolve(qp.pd, need, s.lkey.0, s.addr, s.len as u64, &mut out)
            .map_err(local_err)?;
    }
    Ok(out)
}

/// Checked local ranges of a WRITE/SEND source (SGEs, or the inline bytes in the WQE copy,
/// or both in WQE order).
pub(crate) fn gather(
    g: &MrGuard<'_>,
    qp: &Qp,
    l: &ParsedLocal<'_>,
) -> Result<SmallVec<[MemRange; 4]>, Fail> {
    let ranges = match l {
        ParsedLocal::Sges(list) => local_ranges(g, qp, Access::NONE, list)?,
        ParsedLocal::Inline(bytes) => {
            if bytes.len() as u32 > qp.max_inline {
                return Err((Syndrome::LocalLength, vendor::TOO_LONG));
            }
            smallvec::smallvec![MemRange::host(bytes.as_ptr() as u64, bytes.len() as u64)]
        }
        ParsedLocal::Mixed(_) => {
            if l.inline_len() > qp.max_inline as u64 {
                return Err((Syndrome::LocalLength, vendor::TOO_LONG));
            }
            let mut out = SmallVec::new();
            for seg in l.segments() {
                match seg {
                    LocalSeg::Inline(b) => {
                        out.push(MemRange::host(b.as_ptr() as u64, b.len() as u64))
                    }
                    LocalSeg::Sge(s) => g
                        .resolve(
                            qp.pd,
                            Access::NONE,
                            s.lkey.0,
                            s.addr,
                            s.len as u64,
                            &mut out,
                        )
                        .map_err(local_err)?,
                }
            }
            out
        }
    };
    if total(&ranges) > MAX_MSG {
        return Err((Syndrome::LocalLength, vendor::TOO_LONG));
    }
    Ok(ranges)
}
