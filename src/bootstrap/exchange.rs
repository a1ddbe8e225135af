//! The rendezvous of N ranks as an interface: [`Exchange`], which the TCP
//! [`Bootstrap`](super::Bootstrap) implements and, with the cargo feature `mpi`, the launcher's
//! MPI (`MpiExchange`) does too; [`ExchangeExt`] adds the typed calls
//! (JSON, as the bootstrap sends values) to every implementation, `dyn Exchange` included.
//!
//! Code that sets up connections takes `&mut dyn Exchange` (or `impl Exchange`) and runs the
//! same whether the job was started by torchrun-style variables, perftest-style server and
//! client, `mpirun` or Slurm:
//!
//! ```no_run
//! use gpuverbs::bootstrap::{Exchange, ExchangeExt, Result};
//!
//! /// Every rank's value, in rank order, once every rank has arrived.
//! fn gather_ids(ex: &mut dyn Exchange, mine: u64) -> Result<Vec<u64>> {
//!     let all: Vec<u64> = ex.all_gather(&mine)?;
//!     ex.barrier()?;
//!     Ok(all)
//! }
//! ```
//!
//! Every call is collective: all ranks make the same calls in the same order.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::error::{BootstrapError, Result};

/// The out-of-band rendezvous of a job of [`world_size`](Exchange::world_size) ranks: what
/// peers need to find each other before any RDMA traffic flows (endpoints, memory
/// descriptors), moved as byte frames.
///
/// The trait is object safe; the typed calls are in [`ExchangeExt`], which every implementation
/// (and `dyn Exchange`) has.
pub trait Exchange {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> u32;

    /// The number of ranks of the job.
    fn world_size(&self) -> u32;

    /// Gather every rank's frame on every rank: `result[r]` is rank r's `mine`. Frames may have
    /// any length, different on each rank (empty included), up to the implementation's frame
    /// limit; a frame over it is refused with [`BootstrapError::FrameTooLarge`].
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Wait until every rank has called `barrier`.
    fn barrier(&mut self) -> Result<()>;

    /// Send `mine` to the other rank of a two-rank job and return its frame; any other world
    /// size is [`BootstrapError::NotPairwise`]. Both ranks call it. The provided version is an
    /// all-gather of the two frames; an implementation may move them more directly (the TCP
    /// bootstrap does), as long as every rank of it does the same.
    fn exchange_bytes(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
        let peer = pair_peer(self.rank(), self.world_size(), "exchange")?;
        let mut all = self.all_gather_bytes(mine)?;
        Ok(std::mem::take(&mut all[peer as usize]))
    }
}

/// The typed calls over any [`Exchange`]: values travel as JSON (serde_json), one frame each,
/// as the TCP bootstrap sends them. Implemented for every `Exchange`, `dyn Exchange` included.
pub trait ExchangeExt: Exchange {
    /// Gather every rank's value on every rank, in rank order (`result[r]` is rank r's value).
    /// Every frame is received before any is decoded, so a value one rank cannot decode does
    /// not strand the others.
    fn all_gather<T: Serialize + DeserializeOwned>(&mut self, mine: &T) -> Result<Vec<T>> {
        let bytes = serde_json::to_vec(mine).map_err(BootstrapError::Encode)?;
        let frames = self.all_gather_bytes(&bytes)?;
        frames
            .iter()
            .enumerate()
            .map(|(r, f)| decode(r as u32, f))
            .collect()
    }

    /// Send `mine` to the other rank of a two-rank job and return its value (both ranks call
    /// it; [`BootstrapError::NotPairwise`] for any other world size).
    fn exchange<T: Serialize + DeserializeOwned>(&mut self, mine: &T) -> Result<T> {
        let peer = pair_peer(self.rank(), self.world_size(), "exchange")?;
        let bytes = serde_json::to_vec(mine).map_err(BootstrapError::Encode)?;
        let theirs = self.exchange_bytes(&bytes)?;
        decode(peer, &theirs)
    }
}

impl<E: Exchange + ?Sized> ExchangeExt for E {}

/// `&mut E` and `Box<E>` are exchanges too: every call goes to the `E` behind them.
macro_rules! forward_exchange {
    ($($ty:ty),*) => {$(
        impl<E: Exchange + ?Sized> Exchange for $ty {
            fn rank(&self) -> u32 {
                (**self).rank()
            }

            fn world_size(&self) -> u32 {
                (**self).world_size()
            }

            fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
                (**self).all_gather_bytes(mine)
            }

            fn barrier(&mut self) -> Result<()> {
                (**self).barrier()
            }

            fn exchange_bytes(&mut self, mine: &[u8]) -> Result<Vec<u8>> {
                (**self).exchange_bytes(mine)
            }
        }
    )*};
}

forward_exchange!(&mut E, Box<E>);

/// The other rank of a two-rank job, or [`BootstrapError::NotPairwise`].
pub(crate) fn pair_peer(rank: u32, world_size: u32, op: &'static str) -> Result<u32> {
    if world_size != 2 {
        return Err(BootstrapError::NotPairwise { op, world_size });
    }
    Ok(1 - rank)
}

/// Decode rank `rank`'s JSON frame.
pub(crate) fn decode<T: DeserializeOwned>(rank: u32, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|source| BootstrapError::Decode {
        rank,
        len: bytes.len(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-memory "job" of one rank: all-gather returns the frame itself (or, garbled, bytes
    /// that decode as nothing).
    struct Alone {
        garble: bool,
    }

    impl Exchange for Alone {
        fn rank(&self) -> u32 {
            0
        }
        fn world_size(&self) -> u32 {
            1
        }
        fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
            Ok(vec![if self.garble {
                b"{not json".to_vec()
            } else {
                mine.to_vec()
            }])
        }
        fn barrier(&mut self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn typed_calls_over_dyn() {
        let mut a = Alone { garble: false };
        let ex: &mut dyn Exchange = &mut a;
        let all: Vec<(u32, String)> = ex.all_gather(&(7, "x".to_string())).unwrap();
        assert_eq!(all, [(7, "x".to_string())]);
        ex.barrier().unwrap();
        assert!(matches!(
            ex.exchange(&1u8),
            Err(BootstrapError::NotPairwise {
                op: "exchange",
                world_size: 1
            })
        ));
        assert!(matches!(
            ex.exchange_bytes(b"x"),
            Err(BootstrapError::NotPairwise { .. })
        ));
        // A frame that is not the value asked for is a decode error naming its rank.
        let r = Alone { garble: true }.all_gather(&1u64);
        assert!(matches!(
            r,
            Err(BootstrapError::Decode {
                rank: 0,
                len: 9,
                ..
            })
        ));
        // Boxes and references are exchanges too.
        let mut boxed: Box<dyn Exchange> = Box::new(Alone { garble: false });
        assert_eq!(boxed.all_gather(&3u8).unwrap(), [3]);
    }
}
