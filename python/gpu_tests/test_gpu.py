"""The Python package on a GPU (run on the GPU machine; CI has none): torch and CuPy memory in
GPU memory registered without copying, a kernel built by torch.utils.cpp_extension.load_inline
that puts and signals through an exported QP (GPU doorbell, CPU proxy, rings in GPU memory),
and samples/python/ep_moe.py at N = 2 and 4, validated.

    python3 -m pytest -q python/gpu_tests
"""

import os
import subprocess
import sys

import cupy
import pytest
import torch

import gpuverbs as gv

ALL = gv.ACCESS_LOCAL_WRITE | gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ | gv.ACCESS_REMOTE_ATOMIC
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGET_NS = 5_000_000_000

KERNEL = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <gpuverbs/gpuverbs.cuh>

// One thread per chunk: put its chunk, then thread 0 signals after a barrier and waits for
// every completion. status = {status, syndrome}.
__global__ void put_signal_kernel(gpuverbs_qp* q, uint64_t laddr, uint32_t lk, uint64_t raddr,
                                  uint32_t rk, uint32_t chunk, uint64_t sig, uint32_t sk,
                                  uint64_t budget, int* st) {
    using namespace gpuverbs;
    uint64_t off = (uint64_t)threadIdx.x * chunk;
    status s = put(q, laddr + off, lkey{lk}, raddr + off, rkey{rk}, chunk, false, budget);
    if (s != OK && atomicCAS(st, 0, (int)s) == 0 && s == ERROR_CQE) {
        st[1] = last_error(q).syndrome;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        s = signal(q, sig, rkey{sk}, 1, false, budget);
        if (s == OK) s = quiet(q, budget);
        if (s != OK && atomicCAS(st, 0, (int)s) == 0 && s == ERROR_CQE) {
            st[1] = last_error(q).syndrome;
        }
    }
}

void put_signal(int64_t q, int64_t laddr, int64_t lk, int64_t raddr, int64_t rk,
                int64_t chunk, int64_t threads, int64_t sig, int64_t sk, int64_t budget,
                torch::Tensor status) {
    put_signal_kernel<<<1, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        (gpuverbs_qp*)q, laddr, (uint32_t)lk, raddr, (uint32_t)rk, (uint32_t)chunk, sig,
        (uint32_t)sk, budget, status.data_ptr<int>());
}

int64_t header_version() { return GPUVERBS_DESC_VERSION; }
"""


@pytest.fixture(scope="module")
def ext():
    from torch.utils.cpp_extension import load_inline

    major, minor = torch.cuda.get_device_capability()
    return load_inline(
        name="gpuverbs_put_signal",
        cpp_sources="void put_signal(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, "
        "int64_t, int64_t, int64_t, int64_t, torch::Tensor); int64_t header_version();",
        cuda_sources=KERNEL,
        functions=["put_signal", "header_version"],
        extra_include_paths=[gv.include_dir()],
        extra_cuda_cflags=["-std=c++17", f"-arch=sm_{major}{minor}"],
        verbose=False,
    )


def pair(doorbell="auto", rings="host"):
    gpu = gv.Gpu(0)
    a, b = gv.Context("soft"), gv.Context("soft")
    pa, pb = a.alloc_pd(), b.alloc_pd()
    ring_gpu = gpu if rings == "gpu" else None
    cqa = a.create_cq(256, rings=rings, gpu=ring_gpu)
    cqb = b.create_cq(256)
    qa = pa.create_qp(cqa, cqa, doorbell=doorbell, rings=rings, gpu=ring_gpu)
    qb = pb.create_qp(cqb, cqb)
    qa.connect(qb.endpoint(), access=0)
    qb.connect(qa.endpoint(), access=gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_ATOMIC)
    return gpu, (a, pa, qa), (b, pb, qb)


def test_gpu_tensors_register_without_copying_and_carry_writes():
    gpu = gv.Gpu(0)
    assert gpu.name and gpu.compute_capability >= (8, 0), gpu
    _, (a, pa, qa), (b, pb, qb) = pair()
    src = torch.arange(4096, dtype=torch.int32, device="cuda")
    dst = torch.zeros(4096, dtype=torch.int32, device="cuda")
    ms, md = pa.register(src), pb.register(dst, ALL)
    assert (ms.addr, ms.length, ms.memory) == (src.data_ptr(), 16384, "gpu")
    assert (md.addr, md.memory) == (dst.data_ptr(), "gpu")
    # CuPy: __cuda_array_interface__ and DLPack both lead to the same bytes
    c = cupy.arange(1000, dtype=cupy.float64)
    mc = pa.register(c)
    assert (mc.addr, mc.length, mc.memory) == (c.data.ptr, 8000, "gpu")
    torch.cuda.synchronize()
    with qa.initiator() as ini:
        ini.write(ms, 0, 16384, gv.RemoteMemory(md.remote_memory()))
        ini.wait_send()
    assert torch.equal(dst, src)
    # a pinned host tensor registers as host memory
    pinned = torch.zeros(1024, dtype=torch.uint8).pin_memory()
    assert pa.register(pinned).memory == "host"


@pytest.mark.parametrize(
    "doorbell,rings",
    [("gpu_doorbell", "host"), ("blueflame", "host"), ("cpu_proxy", "host"),
     ("gpu_doorbell", "gpu"), ("cpu_proxy", "gpu")],
)
def test_a_load_inline_kernel_puts_and_signals(ext, doorbell, rings):
    assert ext.header_version() == gv.DESC_VERSION
    gpu, (a, pa, qa), (b, pb, qb) = pair(doorbell, rings)
    threads, chunk = 64, 4096
    src = torch.randint(0, 255, (threads * chunk,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    sig = torch.zeros(1, dtype=torch.int64, device="cuda")
    ms, md = pa.register(src), pb.register(dst, ALL)
    msig = pb.register(sig, ALL)
    status = torch.zeros(2, dtype=torch.int32, device="cuda")
    with qa.export(gpu, header_version=ext.header_version()) as e:
        assert (e.doorbell_mode, e.ring_placement) == (doorbell, rings)
        assert e.ptr != 0
        ext.put_signal(e.ptr, ms.addr, ms.lkey, md.addr, md.rkey, chunk, threads, msig.addr,
                       msig.rkey, BUDGET_NS, status)
        torch.cuda.synchronize()
        assert status.tolist() == [0, 0]
        c = e.counters()
        assert c["sq_error"] == 0 and c["sq_retired"] == c["sq_ready"] > 0, c
    assert torch.equal(dst, src)
    assert int(sig.item()) == 1
    if rings == "host":
        # the export is closed: the host may post again
        with qa.initiator() as ini:
            ini.write(ms, 0, 64, gv.RemoteMemory(md.remote_memory()), 0)
            ini.wait_send()


def test_a_bad_rkey_reaches_the_kernel_as_an_error_status(ext):
    gpu, (a, pa, qa), (b, pb, qb) = pair("gpu_doorbell")
    src = torch.ones(4096, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    ms, md = pa.register(src), pb.register(dst, ALL)
    status = torch.zeros(2, dtype=torch.int32, device="cuda")
    with qa.export(gpu) as e:
        ext.put_signal(e.ptr, ms.addr, ms.lkey, md.addr, md.rkey ^ 0x5A5A00, 64, 1, md.addr,
                       md.rkey, BUDGET_NS, status)
        torch.cuda.synchronize()
    assert status.tolist() == [1, 0x13], status  # ERROR_CQE, REMOTE_ACCESS
    assert qa.state == "ERR"


def test_an_export_for_other_headers_is_refused_on_the_gpu_too():
    gpu, (a, pa, qa), _ = pair()
    with pytest.raises(gv.DescVersionError):
        qa.export(gpu, header_version=gv.DESC_VERSION + 1)
    with qa.export(gpu) as e:
        assert e.counters()["version"] == gv.DESC_VERSION


def ep_moe(n, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", os.path.join(ROOT, "samples/python/ep_moe.py"),
           "--iters", "3", "--warmup", "1", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "every token of both phases validated" in r.stdout, r.stdout
    return r.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_ep_moe_dispatch_and_combine_validate(n):
    out = ep_moe(n, "--tokens", "128", "--hidden", "7168", "--topk", "8", "--experts", "256")
    print(out)
