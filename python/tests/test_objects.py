"""Registration of every kind of object (buffer protocol, DLPack, __cuda_array_interface__),
QP options and their report, and the export's descriptor-version check, on the soft NIC
without a GPU (tests/gpu/ covers GPU memory and exports on a GPU)."""

import ctypes

import numpy as np
import pytest
import torch

import gpuverbs as gv

ALL = gv.ACCESS_LOCAL_WRITE | gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ | gv.ACCESS_REMOTE_ATOMIC


def loopback():
    ctx = gv.Context("soft")
    pd = ctx.alloc_pd()
    cq = ctx.create_cq()
    qp = pd.create_qp(cq, cq)
    qp.connect(qp.endpoint(), access=gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ)
    return pd, qp


def test_torch_host_tensors_register_through_dlpack_without_copying():
    pd, qp = loopback()
    src = torch.arange(1024, dtype=torch.int32)
    dst = torch.zeros((32, 32), dtype=torch.int32)
    ms, md = pd.register(src, ALL), pd.register(dst, ALL)
    assert (ms.addr, ms.length, ms.memory) == (src.data_ptr(), 4096, "host")
    assert (md.addr, md.length) == (dst.data_ptr(), 4096)
    # a view with an offset registers its own bytes
    view = dst[4:8]
    mv = pd.register(view, ALL)
    assert (mv.addr, mv.length) == (view.data_ptr(), 4 * 32 * 4)
    with qp.initiator() as ini:
        ini.write(ms, 0, 4096, gv.RemoteMemory(md.remote_memory()))
        ini.wait_send()
    assert torch.equal(dst.flatten(), src), "the WRITE landed in the tensor itself"
    # bf16 (no buffer protocol in NumPy's sense) is bytes all the same
    b = torch.ones(100, dtype=torch.bfloat16)
    assert pd.register(b).length == 200


def test_objects_that_cannot_be_registered_are_refused_with_reasons():
    pd = gv.Context("soft").alloc_pd()
    with pytest.raises(gv.InvalidArgument, match="C-contiguous"):
        pd.register(torch.zeros(8, 8).t())
    with pytest.raises(gv.InvalidArgument, match="DLPack"):
        pd.register(object())
    with pytest.raises(gv.InvalidArgument, match="at least one byte"):
        pd.register(torch.zeros(0))

    class FakeCuda:
        """Claims host memory is a CUDA array."""

        def __init__(self, host):
            self.host = host
            self.__cuda_array_interface__ = {
                "data": (ctypes.addressof(host), False),
                "shape": (64,),
                "typestr": "<u1",
                "strides": None,
                "version": 3,
            }

    with pytest.raises(gv.InvalidArgument, match="not device memory"):
        pd.register(FakeCuda((ctypes.c_uint8 * 64)()))

    class Strided(FakeCuda):
        def __init__(self, host):
            super().__init__(host)
            self.__cuda_array_interface__["shape"] = (8, 4)
            self.__cuda_array_interface__["strides"] = (1, 8)

    with pytest.raises(gv.InvalidArgument, match="C-contiguous"):
        pd.register(Strided((ctypes.c_uint8 * 64)()))


def test_a_qp_reports_its_doorbell_mode_and_ring_placement():
    ctx = gv.Context("soft")
    pd, cq = ctx.alloc_pd(), ctx.create_cq()
    qp = pd.create_qp(cq, cq)
    assert qp.doorbell_mode in ("gpu_doorbell", "blueflame", "cpu_proxy")
    assert qp.doorbell_reason
    # automatic placement without a GPU: host memory, and it says so
    assert qp.ring_placement == "host" and cq.ring_placement == "host"
    assert qp.placement_reason.startswith("auto: host memory, no GPU given"), qp.placement_reason
    assert cq.placement_reason.startswith("auto: host memory"), cq.placement_reason
    asked = pd.create_qp(cq, cq, rings="host")
    assert (asked.ring_placement, asked.placement_reason) == ("host", "requested")
    px = pd.create_qp(cq, cq, doorbell="cpu_proxy")
    assert px.doorbell_mode == "cpu_proxy"
    with pytest.raises(gv.InvalidArgument, match="doorbell"):
        pd.create_qp(cq, cq, doorbell="loud")
    with pytest.raises(gv.InvalidArgument, match="rings"):
        pd.create_qp(cq, cq, rings="disk")
    # GPU rings need a GPU named
    with pytest.raises(gv.GpuverbsError):
        pd.create_qp(cq, cq, rings="gpu")


def test_an_export_for_headers_of_another_version_is_refused_before_anything():
    pd, qp = loopback()
    assert isinstance(gv.DESC_VERSION, int) and gv.DESC_VERSION != 0
    with pytest.raises(gv.DescVersionError, match=f"{gv.DESC_VERSION ^ 1:#010x}"):
        qp.export(0, header_version=gv.DESC_VERSION ^ 1)
    # the QP was not claimed: the CPU initiator may still post
    with qp.initiator():
        pass


def test_the_headers_carry_the_version_the_package_checks():
    import os

    text = open(os.path.join(gv.include_dir(), "gpuverbs", "desc.h")).read()
    assert f"#define GPUVERBS_DESC_VERSION {gv.DESC_VERSION:#010x}u" in text
