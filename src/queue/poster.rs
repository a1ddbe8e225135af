//! Who posts to a QP's send queue ([`Poster`]): one poster at a time, claimed and released.

use crate::Error;
use std::sync::{Arc, Mutex, PoisonError};

/// Who posts to a QP's send queue. A send queue has one poster at a time: a CPU initiator
/// ([`Qp::cpu_initiator`](crate::Qp::cpu_initiator)), a GPU export ([`crate::gpu::Gpu::export_qp`]) or the CPU proxy
/// ([`crate::proxy::ProxyTarget::for_qp`]); a GPU export and the proxy that rings for it may
/// hold the QP together (the CPU-proxy doorbell mode). A new poster continues from the queue's
/// state: producer index, SQ space in flight, CQ consumer indexes and owner parity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poster {
    /// A CPU initiator.
    CpuInitiator,
    /// A descriptor exported to a GPU.
    GpuExport,
    /// A CPU-proxy target.
    Proxy,
}

impl std::fmt::Display for Poster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::CpuInitiator => "a CPU initiator",
            Self::GpuExport => "a GPU export",
            Self::Proxy => "a CPU-proxy target",
        })
    }
}

/// The posters that hold a QP now.
#[derive(Debug, Default)]
pub(crate) struct Posters(Mutex<Vec<Poster>>);

impl Posters {
    /// Takes the QP for `who`, or says who holds it.
    pub(crate) fn claim(self: &Arc<Self>, who: Poster) -> Result<PosterClaim, Error> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let together = |a: Poster, b: Poster| {
            matches!(
                (a, b),
                (Poster::GpuExport, Poster::Proxy) | (Poster::Proxy, Poster::GpuExport)
            )
        };
        if let Some(&h) = held.iter().find(|&&h| !together(h, who)) {
            return Err(Error::PosterBusy {
                held: h,
                wanted: who,
            });
        }
        held.push(who);
        drop(held);
        Ok(PosterClaim {
            posters: self.clone(),
            who,
        })
    }
}

impl Posters {
    /// Whether `who` holds the QP now.
    pub(crate) fn holds(&self, who: Poster) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&who)
    }
}

/// A poster's hold on a QP; dropping it lets the next poster in.
#[derive(Debug)]
pub(crate) struct PosterClaim {
    posters: Arc<Posters>,
    who: Poster,
}

impl Drop for PosterClaim {
    fn drop(&mut self) {
        let mut held = self
            .posters
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = held.iter().position(|&h| h == self.who) {
            held.swap_remove(i);
        }
    }
}
