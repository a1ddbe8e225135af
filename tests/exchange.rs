//! The exchange interface over the TCP bootstrap: the generic job of `exchange_job` (raw frames
//! of different lengths, barriers, typed calls, then an RC QP pair connected through the
//! exchanged endpoints and a checked RDMA WRITE) run through `&mut dyn Exchange` by threads, the
//! inherent and trait calls mixed on the wire, and the frame limit. CPU only, 127.0.0.1,
//! ephemeral ports; `tests/mpi_exchange.rs` runs the same job over MPI (feature `mpi`).

mod exchange_job;

use std::thread;
use std::time::Duration;

use gpuverbs::bootstrap::{
    Bootstrap, BootstrapError, Direction, Exchange, ExchangeExt, Listener, DEFAULT_MAX_FRAME,
};
use gpuverbs::Context;

const T: Duration = Duration::from_secs(20);

/// A star of `n` ranks on 127.0.0.1, each rank on its own thread running `job`.
fn star<R: Send + 'static>(n: u32, job: fn(Bootstrap) -> R) -> Vec<R> {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let others: Vec<_> = (1..n)
        .map(|r| thread::spawn(move || job(Bootstrap::join(addr, r, n, T).unwrap())))
        .collect();
    let mut out = vec![job(listener.accept_ranks(n, T).unwrap())];
    out.extend(others.into_iter().map(|h| h.join().unwrap()));
    out
}

#[test]
fn two_threads_connect_a_qp_pair_through_dyn_exchange() {
    let checked = star(2, |mut bs| {
        let ex: &mut dyn Exchange = &mut bs;
        exchange_job::collectives(ex);
        let ctx = Context::open_soft(Default::default()).unwrap();
        exchange_job::rdma_write(ex, &ctx)
    });
    let total: usize = exchange_job::WRITES.iter().map(|w| w.0).sum();
    assert_eq!(checked, [total, total]);
}

#[test]
fn three_ranks_gather_frames_through_dyn_exchange() {
    let ranks = star(3, |mut bs| {
        exchange_job::collectives(&mut bs);
        // Boxed, as a program that picks its exchange at run time holds it.
        let mut boxed: Box<dyn Exchange> = Box::new(bs);
        boxed.all_gather(&boxed.rank()).unwrap()
    });
    for r in ranks {
        assert_eq!(r, [0, 1, 2]);
    }
}

#[test]
fn inherent_and_trait_calls_move_the_same_frames() {
    // Rank 0 uses the bootstrap's own calls, rank 1 the trait's: they interoperate.
    let out = star(2, |mut bs| {
        if bs.rank() == 0 {
            let a: Vec<String> = bs.all_gather(&"zero".to_string()).unwrap();
            let b: u32 = bs.exchange(&10).unwrap();
            bs.barrier().unwrap();
            (a, b)
        } else {
            let ex: &mut dyn Exchange = &mut bs;
            let a: Vec<String> = ex.all_gather(&"one".to_string()).unwrap();
            let b: u32 = ex.exchange(&11).unwrap();
            ex.barrier().unwrap();
            (a, b)
        }
    });
    let names = vec!["zero".to_string(), "one".to_string()];
    assert_eq!(out, [(names.clone(), 11), (names, 10)]);
}

#[test]
fn a_frame_over_the_limit_is_refused() {
    let out = star(2, |mut bs| {
        assert_eq!(bs.max_frame(), DEFAULT_MAX_FRAME);
        bs.set_max_frame(1000);
        let ex: &mut dyn Exchange = &mut bs;
        // Rank 1 refuses its own frame before sending; rank 0, which would wait for it, sends
        // an acceptable frame of its own in the pairwise call instead.
        if ex.rank() == 1 {
            ex.all_gather_bytes(&[0; 1001]).err()
        } else {
            ex.exchange_bytes(&[0; 1000]).err()
        }
    });
    assert!(out[0].is_some(), "rank 0's peer sent nothing back");
    match &out[1] {
        Some(BootstrapError::FrameTooLarge {
            dir: Direction::Write,
            len: 1001,
            limit: 1000,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}
