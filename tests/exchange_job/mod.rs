//! One rendezvous job over any [`Exchange`], shared by `tests/exchange.rs` (the TCP bootstrap,
//! two threads) and `tests/mpi_exchange.rs` (MPI, two processes under `mpirun`): raw frames of
//! different lengths, barriers, the typed calls, then an RC QP pair connected through the
//! exchanged endpoints and an RDMA WRITE from rank 0 whose every byte rank 1 checks.

#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use gpuverbs::bootstrap::{BootstrapError, Exchange, ExchangeExt};
use gpuverbs::post::{Completion, CtrlFlags, Local, Op, RemoteAddr, RingMode, Rkey};
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, Endpoint, HostBuffer, Mr, Qp, QpOptions,
    RemoteMemory,
};

const T: Duration = Duration::from_secs(20);

/// The frame rank `rank` sends in round `round`: lengths differ by rank and round (an empty one
/// and one over 64 KiB among them), contents by rank, round and position.
pub fn frame(rank: u32, round: u32) -> Vec<u8> {
    let len = match (rank + round) % 3 {
        0 => 0,
        1 => 70_001 + 13 * rank as usize,
        _ => 5 + rank as usize,
    };
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7) ^ (rank as u8).wrapping_mul(31) ^ round as u8)
        .collect()
}

/// The bytes of the `seed`-th write.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// The writes rank 0 makes, `(len, seed)`: one byte, a page, and 64 KiB + 7 (several packets).
pub const WRITES: &[(usize, u8)] = &[(1, 1), (4096, 2), (65_543, 3)];

/// Raw frames, barriers and the typed calls; any world size (the pairwise call needs two).
pub fn collectives(ex: &mut dyn Exchange) {
    let (rank, n) = (ex.rank(), ex.world_size());
    assert!(rank < n, "rank {rank} of {n}");
    for round in 0..3 {
        let all = ex.all_gather_bytes(&frame(rank, round)).unwrap();
        assert_eq!(all.len(), n as usize);
        for (r, f) in all.iter().enumerate() {
            assert_eq!(
                f,
                &frame(r as u32, round),
                "rank {rank}: frame of rank {r}, round {round}"
            );
        }
        ex.barrier().unwrap();
    }
    let names: Vec<(u32, String)> = ex.all_gather(&(rank, format!("rank {rank}"))).unwrap();
    let want: Vec<(u32, String)> = (0..n).map(|r| (r, format!("rank {r}"))).collect();
    assert_eq!(names, want);
    if n == 2 {
        let theirs: String = ex.exchange(&format!("from {rank}")).unwrap();
        assert_eq!(theirs, format!("from {}", 1 - rank));
        let raw = ex.exchange_bytes(&frame(rank, 1)).unwrap();
        assert_eq!(raw, frame(1 - rank, 1));
    } else {
        assert!(matches!(
            ex.exchange(&0u8),
            Err(BootstrapError::NotPairwise { .. })
        ));
    }
    ex.barrier().unwrap();
}

struct Side {
    qp: Qp,
    buf: HostBuffer,
    mr: Mr,
}

fn side(ctx: &Context) -> Side {
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(CqOptions::default()).unwrap();
    let qp = pd.create_qp(QpOptions::new(&cq, &cq)).unwrap();
    let buf = HostBuffer::new(1 << 17);
    let mr = pd
        .register_with(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    Side { qp, buf, mr }
}

/// Two ranks: each makes an RC QP on `ctx`, they all-gather `(Endpoint, RemoteMemory)` and
/// connect; rank 0 writes [`WRITES`] into rank 1's buffer with its CPU initiator, and after each
/// rank 1 checks every byte and tells rank 0. Returns the bytes checked.
pub fn rdma_write(ex: &mut dyn Exchange, ctx: &Context) -> usize {
    assert_eq!(ex.world_size(), 2, "the QP pair needs two ranks");
    let rank = ex.rank();
    let s = side(ctx);
    let mem = RemoteMemory::export_rkey(s.mr.addr(), s.mr.len(), s.mr.rkey().0).unwrap();
    let all: Vec<(Endpoint, RemoteMemory)> = ex.all_gather(&(s.qp.endpoint(), mem)).unwrap();
    let (peer_ep, peer_mem) = &all[1 - rank as usize];
    s.qp.connect(
        peer_ep,
        ConnectOptions {
            access: Access::REMOTE_WRITE,
            // 268 ms ACK timeout: a loaded 2-core machine must not fail a live peer.
            timeout: 16,
            ..Default::default()
        },
    )
    .unwrap();
    ex.barrier().unwrap();

    let mut ini = (rank == 0).then(|| s.qp.cpu_initiator(RingMode::Doca));
    let mut checked = 0;
    for &(len, seed) in WRITES {
        if let Some(ini) = ini.as_mut() {
            s.buf.write(0, &pattern(len, seed));
            let op = Op::Write {
                remote: RemoteAddr {
                    addr: peer_mem.addr(),
                    rkey: Rkey(peer_mem.rkey()),
                },
                local: Local::Sges(&[s.mr.sge(0, len as u32)]),
                imm: None,
            };
            ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
            let c = ini.wait_send(T).unwrap();
            assert!(matches!(c, Completion::Req { .. }), "{c:?}");
        }
        // The completion is rank 0's; the bytes are rank 1's to check.
        ex.barrier().unwrap();
        let good = rank == 0 || s.buf.to_vec()[..len] == pattern(len, seed)[..];
        let verdicts: Vec<bool> = ex.all_gather(&good).unwrap();
        assert!(
            verdicts[1],
            "rank {rank}: rank 1 did not find the {len} bytes of write {seed}"
        );
        checked += len;
    }
    ex.barrier().unwrap();
    checked
}
