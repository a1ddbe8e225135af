"""Endpoints exchanged through the job's own ``torch.distributed`` process group.

A job launched by torchrun or Slurm already has a process group (any backend, gloo
included); ``connect`` all-gathers every rank's QP endpoints and memory descriptors through
it, connects each QP to its peer, and waits at a barrier until every rank's QPs are ready to
receive, so nothing else is needed for the rendezvous.
"""

from collections import abc
from typing import Any, List, Optional

import torch.distributed as dist

from ._gpuverbs import (
    ACCESS_REMOTE_ATOMIC,
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    GpuverbsError,
    InvalidArgument,
    Mr,
    Qp,
    RemoteMemory,
)

__all__ = ["connect"]


def connect(
    qps: abc.Sequence[Optional[Qp]],
    regions: abc.Sequence[Mr] = (),
    group: Optional[Any] = None,
    *,
    access: int = ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC,
    timeout: int = 14,
    retry_cnt: int = 7,
    rnr_retry: int = 7,
) -> List[List[RemoteMemory]]:
    """Connects ``qps[j]`` to rank ``j``'s QP for this rank, for every rank ``j`` of
    ``group`` (the default group when ``None``), and returns every rank's ``regions`` as
    ``RemoteMemory``: ``remote[j][k]`` is region ``k`` of rank ``j``.

    Every rank of the group calls it, with one entry of ``qps`` per rank (``None`` where it
    has no QP to that rank, its own rank usually) and the same number of regions. Rank
    ``j``'s entry for this rank must be a QP whenever this rank's entry for ``j`` is. Each
    QP grants its peer ``access``; ``timeout``, ``retry_cnt`` and ``rnr_retry`` are as in
    ``Qp.connect``. Collective: it returns once every rank's QPs are connected.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if len(qps) != world:
        raise InvalidArgument(f"{len(qps)} QPs for a group of {world} ranks: give one per rank")
    mine = (
        [qp.endpoint() if qp is not None else None for qp in qps],
        [mr.remote_memory() for mr in regions],
    )
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    # check everything before connecting anything: a failing rank leaves no QP half-way
    for j, (eps, mems) in enumerate(gathered):
        if len(eps) != world:
            raise GpuverbsError(f"rank {j} gave {len(eps)} endpoints for {world} ranks")
        if len(mems) != len(regions):
            raise GpuverbsError(f"rank {j} gave {len(mems)} regions, this rank {len(regions)}")
        if qps[j] is not None and eps[rank] is None:
            raise GpuverbsError(f"rank {j} has no QP for rank {rank}, which has one for it")
    for j, qp in enumerate(qps):
        if qp is not None:
            qp.connect(
                gathered[j][0][rank],
                access=access,
                timeout=timeout,
                retry_cnt=retry_cnt,
                rnr_retry=rnr_retry,
            )
    # no rank posts before every peer's QP can receive
    dist.barrier(group)
    return [[RemoteMemory(m) for m in mems] for _, mems in gathered]
