//! The exchange interface over MPI (feature `mpi`): a two-rank job launched by Open MPI's
//! `mpirun`, whose ranks find each other through [`MpiExchange`] alone. They all-gather frames of
//! different lengths, meet at barriers, refuse an oversized frame together and go on, then each
//! opens a soft NIC on the wire (RoCEv2 over UDP, rank r on 127.0.0.(r+1)), connects an RC QP to
//! the other's through the exchanged endpoints, and rank 0 writes with its CPU initiator while
//! rank 1 checks every byte.
//!
//! Run alone (`cargo test -p gpuverbs --features mpi --test mpi_exchange`), the binary starts
//! itself as the job: `mpirun --allow-run-as-root --oversubscribe -np 2 <this binary>`, and
//! passes when every rank did. Under a launcher (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` or
//! `PMIX_RANK` set) it is one rank. A rank that fails aborts the job (`MPI_Abort`), and a job
//! that hangs is ended by a watchdog, so a failure never leaves the other rank waiting.

mod exchange_job;

use std::net::{Ipv4Addr, SocketAddr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::Command;
use std::time::{Duration, Instant};

use gpuverbs::bootstrap::rsmpi::traits::Communicator;
use gpuverbs::bootstrap::{BootstrapError, Direction, Exchange, MpiExchange};
use gpuverbs::Context;

/// How long the whole job may take before it is ended as hung.
const JOB_LIMIT: Duration = Duration::from_secs(180);

fn main() {
    let under_launcher = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if under_launcher {
        rank_main();
    } else {
        launch();
    }
}

/// Start this binary as a two-rank job and pass when it does.
fn launch() {
    let exe = std::env::current_exe().unwrap();
    let args = [
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        "--timeout",
        &JOB_LIMIT.as_secs().to_string(),
    ];
    println!("mpi_exchange: mpirun {} {}", args.join(" "), exe.display());
    let mut child = match Command::new("mpirun").args(args).arg(&exe).spawn() {
        Ok(c) => c,
        Err(e) => {
            println!("mpi_exchange: 0 passed, 1 failed");
            panic!("cannot start mpirun ({e}): install the Debian package openmpi-bin");
        }
    };
    // mpirun's --timeout ends a hung job; this is the last resort should mpirun itself hang.
    let deadline = Instant::now() + JOB_LIMIT + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    match status {
        Some(s) if s.success() => println!("mpi_exchange: 1 passed, 0 failed"),
        other => {
            println!("mpi_exchange: 0 passed, 1 failed");
            panic!("the two-rank job failed: {other:?}");
        }
    }
}

/// One rank of the job.
fn rank_main() {
    let mut ex = MpiExchange::init().expect("MPI_Init");
    let rank = ex.rank();
    std::thread::spawn(move || {
        std::thread::sleep(JOB_LIMIT);
        eprintln!("rank {rank}: still running after {JOB_LIMIT:?}: ending the job");
        std::process::exit(3);
    });
    if let Err(e) = catch_unwind(AssertUnwindSafe(|| job(&mut ex))) {
        let what = e
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| e.downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        eprintln!("rank {rank}: FAILED: {what}");
        // Ends every rank: the other may be waiting in a collective that never completes.
        ex.communicator().abort(1);
    }
    // Dropping the exchange finalises MPI.
}

fn job(ex: &mut MpiExchange) {
    let rank = ex.rank();
    assert_eq!(ex.world_size(), 2, "run with -np 2");
    assert_eq!(ex.communicator().size(), 2);

    exchange_job::collectives(ex);
    println!("rank {rank}: all-gathers (0 B to 70 KB frames), barriers, typed calls: ok");

    // A frame over the limit: every rank learns every length first, so both refuse together,
    // naming rank 1, and the communicator stays usable.
    ex.set_max_frame(1000);
    let big = vec![rank as u8; if rank == 1 { 1001 } else { 10 }];
    match ex.all_gather_bytes(&big) {
        Err(BootstrapError::FrameTooLarge {
            peer: 1,
            dir,
            len: 1001,
            limit: 1000,
        }) => assert_eq!(
            dir,
            if rank == 1 {
                Direction::Write
            } else {
                Direction::Read
            }
        ),
        other => panic!("rank {rank}: {other:?}"),
    }
    let after = ex.all_gather_bytes(&[rank as u8; 1000]).unwrap();
    assert_eq!(after, [vec![0u8; 1000], vec![1u8; 1000]]);
    ex.set_max_frame(gpuverbs::bootstrap::DEFAULT_MAX_FRAME);
    println!(
        "rank {rank}: an oversized frame refused on both ranks, then a frame at the limit: ok"
    );

    // Soft NICs on the wire, one per process, at distinct loopback addresses.
    let ip = Ipv4Addr::new(127, 0, 0, rank as u8 + 1);
    let ctx = Context::open_soft(gpuverbs::soft::DeviceConfig {
        wire: Some(gpuverbs::soft::WireConfig::new(SocketAddr::from((ip, 0)))),
        ..Default::default()
    })
    .unwrap();
    let wire = ctx.wire_addr().expect("a wire port");
    let checked = exchange_job::rdma_write(ex, &ctx);
    let sent = ctx.soft_device().unwrap().counters().wire.tx_packets;
    assert!(
        sent > 0,
        "rank {rank}: the QPs talked over UDP ({sent} datagrams)"
    );
    println!(
        "rank {rank}: RC QP over RoCEv2/UDP ({wire}), {checked} bytes written by rank 0 and \
         checked by rank 1, {sent} datagrams sent: ok"
    );
}
