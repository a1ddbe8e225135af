#!/usr/bin/env python3
"""Expert-parallel MoE dispatch and combine with GPU-initiated RDMA (gpuverbs), next to the same
exchange through torch.distributed.all_to_all_single.

N ranks (torchrun) each hold T tokens of hidden size H (bf16) routed top-k over E experts, E/N
experts per rank. Dispatch: a kernel writes every token to each rank that owns one of its
experts (one RDMA write per token and destination, into that rank's window; or, with --post
chunk, the rows gathered into contiguous chunks and one write per chunk), then the count and a
signal per destination. Combine: each rank waits for every source's signal, applies its
experts (expert e scales a token by 2^((e % 3) - 1), weighted by the router's weight) and writes
the weighted sum back to the token's owner, which sums the contributions in rank order. Values
are chosen so that every product and sum is exact: both phases are checked bit for bit against
a reference computed from the all-gathered inputs.

    torchrun --standalone --nproc-per-node 2 samples/python/ep_moe.py --tokens 128 \\
        --hidden 7168 --topk 8 --experts 256
    gpuverbs emu --devices 4 -- torchrun --standalone --nproc-per-node 4 \\
        samples/python/ep_moe.py --device mlx5

Every rank has its own device: a soft NIC with a RoCEv2 port (``--device soft``), or
``mlx5_<rank>`` (``--device mlx5``, e.g. the emulated devices of ``gpuverbs emu``, each on its
own address). The kernel is built with nvcc against ``gpuverbs.include_dir()`` and launched
through CuPy; tensors are torch's. ``--json`` writes every rank's figures.
"""

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import cupy
import numpy as np
import torch
import torch.distributed as dist

import gpuverbs as gv
import gpuverbs.torch as gvt

HERE = os.path.dirname(os.path.abspath(__file__))
STATUS = {0: "OK", 1: "ERROR_CQE", 2: "TIMEOUT", 3: "INVALID", 4: "BUSY", 5: "FULL", 6: "BROKEN"}
STAGE = {1: "dispatch put", 2: "dispatch signal", 3: "dispatch wait", 4: "combine put",
         5: "combine signal", 6: "combine wait"}


class Args(ctypes.Structure):
    """ep::Args of ep_moe.cu (ep_build_info checks the size)."""

    _fields_ = [
        ("qp", ctypes.c_uint64),
        ("rbase", ctypes.c_uint64),
        ("rkey", ctypes.c_uint64),
        ("win", ctypes.c_uint64),
        ("send_addr", ctypes.c_uint64),
        ("send", ctypes.c_uint64),
        ("send_lkey", ctypes.c_uint32),
        ("cout_addr", ctypes.c_uint64),
        ("cout", ctypes.c_uint64),
        ("cout_lkey", ctypes.c_uint32),
        ("pack_addr", ctypes.c_uint64),
        ("pack", ctypes.c_uint64),
        ("pack_lkey", ctypes.c_uint32),
        ("chunk_rows", ctypes.c_uint32),
        ("send_idx", ctypes.c_uint64),
        ("send_cnt", ctypes.c_uint64),
        ("slot_of", ctypes.c_uint64),
        ("rank", ctypes.c_uint32),
        ("nranks", ctypes.c_uint32),
        ("tokens", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("experts_per_rank", ctypes.c_uint32),
        ("row_bytes", ctypes.c_uint32),
        ("off_comb", ctypes.c_uint64),
        ("off_cnt", ctypes.c_uint64),
        ("off_dsig", ctypes.c_uint64),
        ("off_csig", ctypes.c_uint64),
        ("budget_ns", ctypes.c_uint64),
        ("done", ctypes.c_uint64),
        ("status", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
    ]


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (T)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (H), bf16")
    p.add_argument("--topk", type=int, default=8, help="experts per token (k, at most 8)")
    p.add_argument("--experts", type=int, default=256, help="experts in all (E, a multiple of N)")
    p.add_argument("--device", choices=["soft", "mlx5"], default="soft")
    p.add_argument("--doorbell", default="auto",
                   choices=["auto", "gpu_doorbell", "blueflame", "cpu_proxy"])
    p.add_argument("--rings", choices=["host", "gpu"], default="host")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--blocks", type=int, default=4, help="blocks per destination")
    p.add_argument("--threads", type=int, default=128, help="threads per block (a multiple of 32)")
    p.add_argument("--post", choices=["row", "warp", "chunk", "all"], default="all",
                   help="how the kernels post: a WQE and a doorbell per row (row), a warp's 32 "
                        "rows with one put_warp (warp), or rows gathered into contiguous chunks "
                        "of --chunk-rows, one put per chunk (chunk); all: each, in the same run")
    p.add_argument("--chunk-rows", type=int, default=16, help="rows per put of --post chunk")
    p.add_argument("--budget-ms", type=int, default=20000, help="bound of every GPU wait")
    p.add_argument("--no-baseline", action="store_true", help="skip all_to_all_single")
    p.add_argument("--json", help="append a line with every rank's figures to this file (rank 0)")
    a = p.parse_args()
    if not 1 <= a.topk <= 8:
        p.error("--topk is 1..8")
    if a.threads % 32 or not 32 <= a.threads <= 1024:
        p.error("--threads is a multiple of 32, at most 1024")
    if a.chunk_rows < 1:
        p.error("--chunk-rows is at least 1")
    return a


def build(rank, include):
    """The kernel as a cubin for this GPU, built by rank 0 into a cache named by its inputs."""
    src = os.path.join(HERE, "ep_moe.cu")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    h = hashlib.sha256(open(src, "rb").read() + arch.encode())
    for root, _, files in sorted(os.walk(include)):
        for f in sorted(files):
            h.update(open(os.path.join(root, f), "rb").read())
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "gpuverbs", "ep_moe")
    cubin = os.path.join(cache, f"ep_moe-{h.hexdigest()[:16]}.cubin")
    if rank == 0 and not os.path.exists(cubin):
        os.makedirs(cache, exist_ok=True)
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        tmp = cubin + f".{os.getpid()}"
        subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-O2", "-I", include,
                        "-o", tmp, src], check=True)
        os.rename(tmp, cubin)
    dist.barrier()
    return cupy.RawModule(path=cubin)


def layout(a, rank, n, gen):
    """This rank's tokens, routing and send lists (CPU tensors)."""
    t_, h_, k = a.tokens, a.hidden, a.topk
    epr = a.experts // n
    scores = torch.rand(t_, a.experts, generator=gen)
    ids = scores.topk(k, dim=1).indices.to(torch.int32)
    weights = 2.0 ** (-torch.randint(0, 3, (t_, k), generator=gen).float())
    tt = torch.arange(t_).unsqueeze(1)
    hh = torch.arange(h_).unsqueeze(0)
    x = ((((tt * 131 + hh * 7 + rank * 17) % 16) - 8).float() / 8).to(torch.bfloat16)
    owner = ids // epr
    mask = torch.stack([(owner == d).any(dim=1) for d in range(n)], dim=1)  # [T, N]
    send_idx = torch.zeros(n, t_, dtype=torch.int32)
    slot_of = torch.full((n, t_), -1, dtype=torch.int32)
    cnt = torch.zeros(n, dtype=torch.int32)
    for d in range(n):
        idx = mask[:, d].nonzero().flatten().to(torch.int32)
        cnt[d] = idx.numel()
        send_idx[d, : idx.numel()] = idx
        slot_of[d, idx.long()] = torch.arange(idx.numel(), dtype=torch.int32)
    row = (2 * h_ + 8 * k + 15) // 16 * 16
    rows = torch.zeros(t_, row, dtype=torch.uint8)
    rows[:, : 2 * h_] = x.view(torch.uint8).reshape(t_, 2 * h_)
    rows[:, 2 * h_ : 2 * h_ + 4 * k] = ids.contiguous().view(torch.uint8).reshape(t_, 4 * k)
    rows[:, 2 * h_ + 4 * k : 2 * h_ + 8 * k] = weights.contiguous().view(torch.uint8).reshape(t_, 4 * k)
    return dict(x=x, ids=ids, weights=weights, mask=mask, send_idx=send_idx, slot_of=slot_of,
                cnt=cnt, rows=rows, row=row)


def reference_combine(lay, n, epr):
    """out[t] = sum over ranks d (in order) of bf16(sum over t's experts on d of w * scale * x)."""
    x = lay["x"].float()
    scale = torch.tensor([0.5, 1.0, 2.0])[(lay["ids"] % 3).long()]
    ws = lay["weights"] * scale
    owner = lay["ids"] // epr
    out = torch.zeros_like(x)
    for d in range(n):
        coef = (ws * (owner == d)).sum(dim=1, keepdim=True)
        y = (coef * x).to(torch.bfloat16).float()
        out += torch.where(lay["mask"][:, d : d + 1], y, torch.zeros_like(y))
    return out


def check_status(st, what):
    s = st.tolist()
    if s[0] != 0:
        raise RuntimeError(
            f"{what}: {STATUS.get(s[0], s[0])} at {STAGE.get(s[4], s[4])} (syndrome {s[1]:#x}, "
            f"vendor {s[2]:#x}, wqe {s[3]})")


def main():
    a = parse()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if a.experts % n:
        raise SystemExit(f"--experts {a.experts} is not a multiple of {n} ranks")
    epr = a.experts // n
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    gpu = gv.Gpu(dev.index)
    mod = build(rank, gv.include_dir())
    info = cupy.zeros(2, dtype=cupy.uint32)
    mod.get_function("ep_build_info")((1,), (1,), (info,))
    header_version, args_size = (int(v) for v in info.get())
    if args_size != ctypes.sizeof(Args):
        raise SystemExit(f"ep::Args is {args_size} bytes in the kernel, {ctypes.sizeof(Args)} here")

    lay = layout(a, rank, n, torch.Generator().manual_seed(1234 + rank))
    t_, h_, row = a.tokens, a.hidden, lay["row"]
    hrow = 2 * h_

    def al(v):
        return (v + 255) // 256 * 256

    off_comb = al(n * t_ * row)
    off_cnt = al(off_comb + n * t_ * hrow)
    off_dsig, off_csig = off_cnt + 8 * n, off_cnt + 16 * n
    win = torch.zeros(off_cnt + 24 * n, dtype=torch.uint8, device=dev)
    send = lay["rows"].to(dev)
    cout = torch.zeros(n * t_ * hrow, dtype=torch.uint8, device=dev)
    pack = torch.zeros(n * t_ * row, dtype=torch.uint8, device=dev)
    out = torch.zeros(t_, h_, dtype=torch.float32, device=dev)

    if a.device == "soft":
        # its own address: one soft NIC routes a GID (an IP) to one UDP port
        ctx = gv.Context("soft", wire=f"127.0.{1 + rank // 250}.{1 + rank % 250}:0")
    else:
        ctx = gv.Context(f"mlx5_{rank}")
    pd = ctx.alloc_pd()
    all_rights = (gv.ACCESS_LOCAL_WRITE | gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ
                  | gv.ACCESS_REMOTE_ATOMIC)
    mr_win = pd.register(win, all_rights)
    mr_send, mr_cout, mr_pack = pd.register(send), pd.register(cout), pd.register(pack)
    assert mr_win.memory == mr_send.memory == mr_cout.memory == mr_pack.memory == "gpu"
    ring_gpu = gpu if a.rings == "gpu" else None
    qps = []
    for d in range(n):
        if d == rank:
            qps.append(None)
            continue
        cq = ctx.create_cq(1024, rings=a.rings, gpu=ring_gpu)
        qps.append(pd.create_qp(cq, cq, sq_blocks=1024, rq_wqes=0, max_inline=64,
                                doorbell=a.doorbell, rings=a.rings, gpu=ring_gpu))
    remote = gvt.connect(qps, [mr_win])
    exports = [qp.export(gpu, header_version=header_version) if qp is not None else None
               for qp in qps]
    modes = sorted({e.doorbell_mode for e in exports if e is not None})
    placements = sorted({e.ring_placement for e in exports if e is not None})

    i64 = dict(dtype=torch.int64, device=dev)
    qp_ptrs = torch.tensor([e.ptr if e is not None else 0 for e in exports], **i64)
    rbase = torch.tensor([r[0].addr for r in remote], **i64)
    rkeys = torch.from_numpy(np.array([r[0].rkey for r in remote], dtype=np.uint32).view(np.int32)).to(dev)
    send_idx, cnt, slot_of = (lay[k].to(dev) for k in ("send_idx", "cnt", "slot_of"))
    done = torch.zeros(2 * n, dtype=torch.int32, device=dev)
    status = torch.zeros(5, dtype=torch.int32, device=dev)
    args = Args(
        qp=qp_ptrs.data_ptr(), rbase=rbase.data_ptr(), rkey=rkeys.data_ptr(), win=win.data_ptr(),
        send_addr=mr_send.addr, send=send.data_ptr(), send_lkey=mr_send.lkey,
        cout_addr=mr_cout.addr, cout=cout.data_ptr(), cout_lkey=mr_cout.lkey,
        pack_addr=mr_pack.addr, pack=pack.data_ptr(), pack_lkey=mr_pack.lkey,
        chunk_rows=a.chunk_rows,
        send_idx=send_idx.data_ptr(), send_cnt=cnt.data_ptr(), slot_of=slot_of.data_ptr(),
        rank=rank, nranks=n, tokens=t_, hidden=h_, topk=a.topk, experts_per_rank=epr,
        row_bytes=row, off_comb=off_comb, off_cnt=off_cnt, off_dsig=off_dsig, off_csig=off_csig,
        budget_ns=a.budget_ms * 1_000_000, done=done.data_ptr(), status=status.data_ptr(),
        out=out.data_ptr())
    args_dev = torch.frombuffer(bytearray(bytes(args)), dtype=torch.uint8).to(dev)
    ap = np.uint64(args_dev.data_ptr())
    k_wait, k_red = mod.get_function("ep_wait_dispatch"), mod.get_function("ep_reduce")
    kernels = {"row": ("ep_dispatch", "ep_combine"), "warp": ("ep_dispatch_warp", "ep_combine_warp"),
               "chunk": ("ep_dispatch_chunk", "ep_combine_chunk")}
    posts = list(kernels) if a.post == "all" else [a.post]

    # the reference, from every rank's inputs
    gathered = [None] * n
    dist.all_gather_object(gathered, {k: lay[k] for k in ("rows", "send_idx", "cnt")})
    ref_out = reference_combine(lay, n, epr)

    def check_round(post):
        w = win.cpu()
        for s in range(n):
            c = int(gathered[s]["cnt"][rank])
            want = gathered[s]["rows"][gathered[s]["send_idx"][rank, :c].long()]
            got = w[s * t_ * row : (s * t_ + c) * row].reshape(c, row)
            if not torch.equal(got, want):
                bad = (got != want).any(dim=1).nonzero().flatten()[:4].tolist()
                raise RuntimeError(f"rank {rank} ({post}): rows from rank {s} differ at slots {bad}")
        if not torch.equal(out.cpu(), ref_out):
            diff = (out.cpu() != ref_out).any(dim=1).nonzero().flatten()[:4].tolist()
            raise RuntimeError(f"rank {rank} ({post}): combined tokens {diff} differ from the reference")

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    # The host waits for the exchange asleep (a blocking-sync event), not spinning as
    # torch.cuda.synchronize does: on the soft NIC the device's engine and wire threads need the
    # cores that N spinning ranks would take.
    finished = torch.cuda.Event(blocking=True)
    rounds = 0

    def timed(post):
        """Median dispatch and combine times (µs) of this posting; the first and last rounds are
        checked bit for bit (the window is cleared before each, so old rows cannot pass)."""
        nonlocal rounds
        k_disp, k_comb = (mod.get_function(f) for f in kernels[post])
        t_disp, t_comb = [], []
        for it in range(a.warmup + a.iters):
            rounds += 1
            rnd = np.uint64(rounds)
            check = it == 0 or it == a.warmup + a.iters - 1
            done.zero_()
            out.zero_()
            if check:
                win[: off_comb + n * t_ * hrow].zero_()
            torch.cuda.synchronize()
            dist.barrier()
            ev[0].record()
            k_disp((n, a.blocks), (a.threads,), (ap,))
            k_wait((1,), (max(32, n),), (ap, rnd))
            ev[1].record()
            k_comb((n, a.blocks), (a.threads,), (ap, rnd))
            k_red((t_,), (a.threads,), (ap, rnd))
            ev[2].record()
            finished.record()
            finished.synchronize()
            check_status(status, f"rank {rank} round {rounds} ({post})")
            if check:
                check_round(post)
            if it >= a.warmup:
                t_disp.append(ev[0].elapsed_time(ev[1]) * 1e3)
                t_comb.append(ev[1].elapsed_time(ev[2]) * 1e3)
        return statistics.median(t_disp), statistics.median(t_comb)

    times = {post: timed(post) for post in posts}
    for e in exports:
        if e is not None:
            e.close()

    cnt_l = lay["cnt"].tolist()
    remote_rows = sum(c for d, c in enumerate(cnt_l) if d != rank)
    res = dict(rank=rank, ranks=n, device=ctx.name, doorbell=",".join(modes) or "-",
               rings=",".join(placements) or "-", tokens=t_, hidden=h_, topk=a.topk,
               experts=a.experts, dispatch_bytes=remote_rows * row,
               combine_bytes=sum(int(gathered[s]["cnt"][rank]) for s in range(n) if s != rank)
               * hrow)
    for post, (td, tc) in times.items():
        res[f"{post}_dispatch_us"], res[f"{post}_combine_us"] = td, tc

    if not a.no_baseline:
        res.update(baseline(a, rank, n, lay, gathered, send, win, row, hrow, dev))
    allres = [None] * n
    dist.all_gather_object(allres, res)
    if rank == 0:
        report(allres, a)
    dist.barrier()
    dist.destroy_process_group()


def baseline(a, rank, n, lay, gathered, send, win, row, hrow, dev):
    """The same exchange through all_to_all_single on the process group (gloo: host tensors,
    so each phase copies to the host and back, as a user of that backend would)."""
    t_ = a.tokens
    cnt = lay["cnt"]
    order = torch.cat([lay["send_idx"][d, : int(cnt[d])] for d in range(n)]).long().to(dev)
    in_rows = [int(c) for c in cnt.tolist()]
    out_rows = [int(gathered[s]["cnt"][rank]) for s in range(n)]
    td, tc = [], []
    for it in range(a.warmup + a.iters):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        # counts first, then the rows
        counts = torch.zeros(n, dtype=torch.int64)
        dist.all_to_all_single(counts, cnt.to(torch.int64))
        src = send[order].cpu()
        dst = torch.empty(sum(out_rows), row, dtype=torch.uint8)
        dist.all_to_all_single(dst, src, [c for c in out_rows], [c for c in in_rows])
        recv = dst.to(dev)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        back_src = recv[:, :hrow].cpu()  # stands for the experts' output rows
        back = torch.empty(sum(in_rows), hrow, dtype=torch.uint8)
        dist.all_to_all_single(back, back_src, in_rows, out_rows)
        back.to(dev)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if it == 0:
            assert counts.tolist() == out_rows, (counts.tolist(), out_rows)
            w = win.cpu()
            got = torch.cat([w[s * t_ * row : (s * t_ + out_rows[s]) * row].reshape(-1, row)
                             for s in range(n)])
            assert torch.equal(dst, got), "all_to_all_single and gpuverbs moved different rows"
        if it >= a.warmup:
            td.append((t1 - t0) * 1e6)
            tc.append((t2 - t1) * 1e6)
    return dict(a2a_dispatch_us=statistics.median(td), a2a_combine_us=statistics.median(tc))


def report(allres, a):
    posts = ["row", "warp", "chunk"] if a.post == "all" else [a.post]
    r0 = allres[0]
    print(f"ep_moe: {r0['ranks']} ranks, T={r0['tokens']} H={r0['hidden']} top-{r0['topk']} "
          f"E={r0['experts']} bf16; every token of both phases validated")
    cols = ["rank", "post", "device", "doorbell", "rings", "dispatch_us", "combine_us",
            "dispatch_GBps", "combine_GBps"]
    if not a.no_baseline:
        cols += ["a2a_dispatch_us", "a2a_combine_us", "dispatch_speedup", "combine_speedup"]
    print("  ".join(f"{c:>14}" for c in cols))
    for post in posts:
        for r in allres:
            td, tc = r[f"{post}_dispatch_us"], r[f"{post}_combine_us"]
            row = dict(r, post=post, dispatch_us=td, combine_us=tc,
                       dispatch_GBps=r["dispatch_bytes"] / td / 1e3,
                       combine_GBps=r["combine_bytes"] / tc / 1e3)
            if not a.no_baseline:
                row["dispatch_speedup"] = r["a2a_dispatch_us"] / td
                row["combine_speedup"] = r["a2a_combine_us"] / tc
            print("  ".join(f"{row[c]:>14.2f}" if isinstance(row[c], float) else f"{row[c]:>14}"
                            for c in cols))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(dict(args=vars(a), ranks=allres)) + "\n")


if __name__ == "__main__":
    sys.exit(main())
