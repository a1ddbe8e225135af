"""gpuverbs.torch.connect: endpoints and memory descriptors exchanged through a gloo process
group of two processes (wire soft NICs), then WRITEs both ways checked byte for byte."""

import multiprocessing as mp
import os
import socket

import numpy as np

import gpuverbs as gv

ALL = gv.ACCESS_LOCAL_WRITE | gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ | gv.ACCESS_REMOTE_ATOMIC


def _rank(rank, world, port, errors):
    try:
        import torch.distributed as dist

        import gpuverbs.torch as gvt

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        ctx = gv.Context("soft", wire="127.0.0.1:0")
        pd = ctx.alloc_pd()
        cq = ctx.create_cq()
        qps = [None if j == rank else pd.create_qp(cq, cq) for j in range(world)]
        # one slot of 4 KiB per sender in every rank's inbox
        inbox = np.zeros(world * 4096, dtype=np.uint8)
        outbox = np.full(4096, 0x10 + rank, dtype=np.uint8)
        mr_in, mr_out = pd.register(inbox, ALL), pd.register(outbox, ALL)
        remote = gvt.connect(qps, [mr_in])
        assert len(remote) == world and all(len(r) == 1 for r in remote)
        assert remote[rank][0].addr == mr_in.addr
        for j, qp in enumerate(qps):
            if qp is None:
                continue
            with qp.initiator() as ini:
                ini.write(mr_out, 0, 4096, remote[j][0], rank * 4096)
                ini.wait_send()
        dist.barrier()
        for j in range(world):
            want = 0 if j == rank else 0x10 + j
            assert np.all(inbox[j * 4096 : (j + 1) * 4096] == want), (rank, j)
        # a rank with a QP for a peer that has none for it is told before anything connects
        try:
            gvt.connect([pd.create_qp(cq, cq) if rank == 0 and j == 1 else None for j in range(world)])
        except gv.GpuverbsError as e:
            assert rank == 0 and "has no QP for rank 0" in str(e), e
            dist.barrier()  # rank 1 went on to connect's barrier: release it
        else:
            assert rank == 1, "rank 0 connected a QP its peer has no QP for"
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {e!r}")
        raise


def test_connect_through_a_gloo_process_group_of_two():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, msgs
    assert [p.exitcode for p in procs] == [0, 0]
