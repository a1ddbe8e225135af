//! The rendezvous over the launcher's MPI (cargo feature `mpi`, over rsmpi, the `mpi` crate):
//! [`MpiExchange`] implements [`Exchange`] with `MPI_Allgather` (the frame lengths) then
//! `MPI_Allgatherv` (the frames), and `MPI_Barrier`, on a communicator of the job (by default
//! `MPI_COMM_WORLD`). A job started by `mpirun` or by Slurm's `srun` (with an MPI built for it)
//! finds its peers through the launcher's own fabric: no port to choose, no root address.
//!
//! ```no_run
//! # #[cfg(feature = "mpi")]
//! # fn main() -> Result<(), gpuverbs::bootstrap::BootstrapError> {
//! use gpuverbs::bootstrap::{Exchange, ExchangeExt, MpiExchange};
//!
//! let mut ex = MpiExchange::init()?; // MPI_Init_thread (funneled); MPI_Finalize on drop
//! let names: Vec<String> = ex.all_gather(&format!("rank {}", ex.rank()))?;
//! ex.barrier()?;
//! # Ok(()) }
//! # #[cfg(not(feature = "mpi"))]
//! # fn main() {}
//! ```
//!
//! # Frames and errors
//!
//! Every rank first gathers every frame's length, then checks all of them against the frame
//! limit ([`MpiExchange::set_max_frame`], default [`DEFAULT_MAX_FRAME`]): a frame over it is
//! refused on every rank at once ([`BootstrapError::FrameTooLarge`], naming the rank whose frame
//! it is), before any payload moves, so no rank is left waiting and the communicator stays usable.
//! Frames whose total MPI's `int` counts cannot describe are refused the same way
//! ([`BootstrapError::Mpi`]). MPI's own failures are not returned: under MPI's default error
//! handler (`MPI_ERRORS_ARE_FATAL`) they end the job, as a launcher expects; and MPI's
//! collectives have no timeout.
//!
//! # Threads
//!
//! [`MpiExchange::init`] asks for `MPI_THREAD_FUNNELED` (gpuverbs has threads of its own, the
//! soft NIC's and the proxy's, none of which calls MPI): make every call from the thread that
//! initialised MPI. A program that needs another level initialises MPI itself
//! ([`rsmpi::initialize_with_threading`](::mpi::initialize_with_threading)) and passes the
//! universe ([`MpiExchange::with_universe`]) or a communicator
//! ([`MpiExchange::from_communicator`]).

use std::fmt;

use ::mpi::datatype::PartitionMut;
use ::mpi::environment::Universe;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::{Communicator, CommunicatorCollectives};
use ::mpi::{Count, Threading};

use super::error::{BootstrapError, Direction, Result};
use super::exchange::Exchange;
use super::job::DEFAULT_MAX_FRAME;

/// The rendezvous of an MPI job: every rank of a communicator (by default `MPI_COMM_WORLD`).
///
/// Made by [`MpiExchange::init`] (which initialises MPI and finalises it on drop),
/// [`MpiExchange::with_universe`] (MPI initialised by the program, finalised on drop) or
/// [`MpiExchange::from_communicator`] (MPI the program's, which must outlive this).
pub struct MpiExchange {
    // Declared before `universe`: the communicator goes before MPI_Finalize.
    comm: SimpleCommunicator,
    universe: Option<Universe>,
    rank: u32,
    world_size: u32,
    max_frame: usize,
}

impl fmt::Debug for MpiExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiExchange")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("max_frame", &self.max_frame)
            .field("owns_mpi", &self.universe.is_some())
            .finish()
    }
}

impl MpiExchange {
    /// Initialise MPI (`MPI_Init_thread`, funneled) and take `MPI_COMM_WORLD`; MPI is finalised
    /// when this is dropped. [`BootstrapError::Mpi`] when this process initialised MPI already
    /// (pass that universe to [`MpiExchange::with_universe`] instead) or finalised it.
    pub fn init() -> Result<Self> {
        if ::mpi::is_finalized() {
            return Err(BootstrapError::Mpi(
                "MPI was finalised already in this process; it cannot be initialised again".into(),
            ));
        }
        let Some((universe, provided)) = ::mpi::initialize_with_threading(Threading::Funneled)
        else {
            return Err(BootstrapError::Mpi(
                "MPI is initialised already in this process: pass its universe \
                 (MpiExchange::with_universe) or a communicator (MpiExchange::from_communicator)"
                    .into(),
            ));
        };
        if provided == Threading::Single {
            tracing::warn!(
                "MPI provides MPI_THREAD_SINGLE only; the bootstrap calls MPI from one thread"
            );
        }
        Self::with_universe(universe)
    }

    /// Take an initialised MPI: the exchange runs on `MPI_COMM_WORLD` and finalises MPI (drops
    /// `universe`) when it is dropped.
    pub fn with_universe(universe: Universe) -> Result<Self> {
        let mut ex = Self::from_communicator(universe.world())?;
        ex.universe = Some(universe);
        Ok(ex)
    }

    /// Run the exchange on `comm` (the world, or a communicator split from it); the program keeps
    /// MPI initialised for as long as this is used.
    pub fn from_communicator(comm: SimpleCommunicator) -> Result<Self> {
        let (rank, size) = (comm.rank(), comm.size());
        let bad = || BootstrapError::Mpi(format!("the communicator says rank {rank} of {size}"));
        let rank = u32::try_from(rank).map_err(|_| bad())?;
        let world_size = u32::try_from(size).map_err(|_| bad())?;
        if rank >= world_size {
            return Err(bad());
        }
        tracing::debug!(rank, world_size, "bootstrap: MPI communicator");
        Ok(Self {
            comm,
            universe: None,
            rank,
            world_size,
            max_frame: DEFAULT_MAX_FRAME,
        })
    }

    /// The communicator the exchange runs on.
    pub fn communicator(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// The MPI universe, when this exchange owns it ([`MpiExchange::init`],
    /// [`MpiExchange::with_universe`]).
    pub fn universe(&self) -> Option<&Universe> {
        self.universe.as_ref()
    }

    /// The largest frame sent or accepted.
    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Set the largest frame sent or accepted (default [`DEFAULT_MAX_FRAME`]). All ranks should
    /// agree; each checks every rank's frame against its own limit.
    pub fn set_max_frame(&mut self, limit: usize) {
        self.max_frame = limit;
    }
}

impl Exchange for MpiExchange {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world_size as usize;
        // Every rank learns every length (its own included, even one over the limit) before
        // any payload moves, and so refuses with the others.
        let my_len = mine.len() as u64;
        let mut lens = vec![0u64; n];
        self.comm.all_gather_into(&my_len, &mut lens[..]);
        check_lengths(self.rank, &lens, self.max_frame)?;
        let (counts, displs, total) = partition(&lens)?;
        let mut all = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            self.comm.all_gather_varcount_into(mine, &mut part);
        }
        let mut frames = Vec::with_capacity(n);
        let mut rest = &all[..];
        for &c in &counts {
            let (frame, tail) = rest.split_at(c as usize);
            frames.push(frame.to_vec());
            rest = tail;
        }
        Ok(frames)
    }

    fn barrier(&mut self) -> Result<()> {
        self.comm.barrier();
        Ok(())
    }
}

/// MPI's counts and displacements of frames of `lens` bytes, and their total, or
/// [`BootstrapError::Mpi`] when the total is past what an MPI `int` counts.
fn partition(lens: &[u64]) -> Result<(Vec<Count>, Vec<Count>, usize)> {
    let total = lens.iter().try_fold(0u64, |t, &l| t.checked_add(l));
    let total = match total.map(Count::try_from) {
        Some(Ok(t)) => t,
        _ => {
            return Err(BootstrapError::Mpi(format!(
                "{} frames of {lens:?} bytes total more than MPI's int counts reach ({})",
                lens.len(),
                Count::MAX
            )))
        }
    };
    // Each length and offset is at most `total`, which fits in an MPI count.
    let counts: Vec<Count> = lens.iter().map(|&l| l as Count).collect();
    let displs: Vec<Count> = counts
        .iter()
        .scan(0, |at: &mut Count, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect();
    Ok((counts, displs, total as usize))
}

/// Check every rank's frame length against `limit`, in rank order: the first over it is
/// [`BootstrapError::FrameTooLarge`] (this rank's own frame as written, another's as read).
/// Every rank calls it with the same lengths, so every rank refuses together and none waits
/// for the others.
fn check_lengths(rank: u32, lens: &[u64], limit: usize) -> Result<()> {
    for (r, &len) in lens.iter().enumerate() {
        if len > limit as u64 {
            return Err(BootstrapError::FrameTooLarge {
                peer: r as u32,
                dir: if r as u32 == rank {
                    Direction::Write
                } else {
                    Direction::Read
                },
                len,
                limit,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_fit_mpi_counts() {
        assert_eq!(
            partition(&[0, 5, 3, 0]).unwrap(),
            (vec![0, 5, 3, 0], vec![0, 0, 5, 8], 8)
        );
        assert_eq!(partition(&[]).unwrap(), (vec![], vec![], 0));
        let max = Count::MAX as u64;
        assert_eq!(partition(&[max - 1, 1]).unwrap().2, Count::MAX as usize);
        for lens in [&[max, 1][..], &[u64::MAX, 1], &[max + 1]] {
            assert!(
                matches!(partition(lens), Err(BootstrapError::Mpi(ref m)) if m.contains("int")),
                "{lens:?}"
            );
        }
    }

    #[test]
    fn lengths_over_the_limit_name_the_rank_and_direction() {
        assert!(check_lengths(0, &[0, 10, 10], 10).is_ok());
        match check_lengths(1, &[1, 11, 12], 10) {
            Err(BootstrapError::FrameTooLarge {
                peer: 1,
                dir: Direction::Write,
                len: 11,
                limit: 10,
            }) => {}
            other => panic!("{other:?}"),
        }
        match check_lengths(0, &[1, 2, 12], 10) {
            Err(BootstrapError::FrameTooLarge {
                peer: 2,
                dir: Direction::Read,
                len: 12,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
