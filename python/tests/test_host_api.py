"""The gpuverbs package on the soft NIC: registration of each kind of object, loopback and
two-process WRITE / READ / SEND / atomics with byte checks, every error class as its
exception, recovery after an error."""

import multiprocessing as mp
import struct

import numpy as np
import pytest

import gpuverbs as gv

ALL = gv.ACCESS_LOCAL_WRITE | gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ | gv.ACCESS_REMOTE_ATOMIC


class Side:
    """A QP with its own CQs and a registered 64 KiB NumPy buffer."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.pd = ctx.alloc_pd()
        self.scq, self.rcq = ctx.create_cq(), ctx.create_cq()
        self.qp = self.pd.create_qp(self.scq, self.rcq)
        self.buf = np.zeros(1 << 16, dtype=np.uint8)
        self.mr = self.pd.register(self.buf, ALL)


def pair(access=gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ | gv.ACCESS_REMOTE_ATOMIC, **kw):
    a, b = Side(gv.Context("soft")), Side(gv.Context("soft"))
    a.qp.connect(b.qp.endpoint(), access=access, **kw)
    b.qp.connect(a.qp.endpoint(), access=access, **kw)
    return a, b


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint32) * 31) ^ seed).astype(np.uint8)


def test_context_reports_its_device():
    ctx = gv.Context("soft")
    assert ctx.kind == "soft" and ctx.name.startswith("softnic"), repr(ctx)
    assert ctx.wire_addr is None
    w = gv.Context("soft", wire="127.0.0.1:0")
    assert w.wire_addr.startswith("127.0.0.1:")
    with pytest.raises(gv.NoSuchDeviceError):
        gv.Context("no-such-device")
    with pytest.raises(gv.InvalidArgument):
        gv.Context("soft", wire="not an address")


def test_every_kind_of_buffer_registers_without_copying():
    pd = gv.Context("soft").alloc_pd()
    arr = np.zeros((64, 16), dtype=np.float32)
    mr = pd.register(arr, ALL)
    assert (mr.addr, mr.length) == (arr.ctypes.data, arr.nbytes)
    ba = bytearray(4096)
    mr2 = pd.register(ba)
    assert mr2.length == 4096
    mv = memoryview(bytearray(100))
    assert pd.register(mv).length == 100
    # read-only memory registers for reading only
    ro = b"x" * 64
    assert pd.register(ro, gv.ACCESS_REMOTE_READ).length == 64
    with pytest.raises(gv.InvalidArgument, match="read-only"):
        pd.register(ro, gv.ACCESS_LOCAL_WRITE)
    with pytest.raises(gv.InvalidArgument, match="C-contiguous"):
        pd.register(np.zeros((8, 8))[:, ::2])
    with pytest.raises(gv.InvalidArgument):
        pd.register(42)
    with pytest.raises(gv.InvalidArgument):
        pd.register(bytearray())
    # the region keeps the buffer exported: it cannot be resized under the registration
    with pytest.raises(BufferError):
        ba.extend(b"more")
    del mr2
    ba.extend(b"more")


def test_write_read_send_and_atomics_in_loopback():
    a, b = pair()
    rb = gv.RemoteMemory(b.mr.remote_memory())
    assert (rb.addr, rb.length, rb.rkey) == (b.mr.addr, b.mr.length, b.mr.rkey)
    with a.qp.initiator() as ini, b.qp.initiator() as resp:
        for i, n in enumerate([1, 64, 4096, 20000]):
            a.buf[:n] = pattern(n, i)
            ini.write(a.mr, 0, n, rb, 8192)
            c = ini.wait_send()
            assert (c.kind, c.opcode) == ("send", 0x08)
            assert np.array_equal(b.buf[8192 : 8192 + n], a.buf[:n])
        # READ back into another part of A
        ini.read(a.mr, 32768, 4096, rb, 8192)
        assert ini.wait_send().opcode == 0x10
        assert np.array_equal(a.buf[32768 : 32768 + 4096], b.buf[8192 : 8192 + 4096])
        # SEND with an immediate into a posted receive
        resp.post_recv(b.mr, 0, 256)
        a.buf[:100] = pattern(100, 7)
        ini.send(a.mr, 0, 100, imm=0xABCD)
        ini.wait_send()
        r = resp.wait_recv()
        assert (r.kind, r.byte_count, r.imm, r.wqe_counter) == ("recv", 100, 0xABCD, 0)
        assert np.array_equal(b.buf[:100], a.buf[:100])
        # WRITE with immediate consumes a receive
        resp.post_recv(b.mr, 0, 8)
        ini.write(a.mr, 0, 16, rb, 40000, imm=5)
        ini.wait_send()
        assert resp.wait_recv().imm == 5
        # atomics on an 8-byte word of B
        struct.pack_into("<Q", b.buf, 50000, 40)
        ini.fetch_add(a.mr, 60000, rb, 50000, 2)
        ini.wait_send()
        assert struct.unpack_from("<Q", a.buf, 60000)[0] == 40
        ini.compare_swap(a.mr, 60008, rb, 50000, 42, 7)
        ini.wait_send()
        assert struct.unpack_from("<Q", a.buf, 60008)[0] == 42
        assert struct.unpack_from("<Q", b.buf, 50000)[0] == 7


def test_bounds_are_checked_before_posting():
    a, b = pair()
    rb = gv.RemoteMemory(b.mr.remote_memory())
    with a.qp.initiator() as ini:
        with pytest.raises(gv.InvalidArgument, match="do not fit a region"):
            ini.write(a.mr, 65536 - 8, 16, rb)
        with pytest.raises(gv.InvalidArgument, match="remote memory"):
            ini.write(a.mr, 0, 16, rb, 65536 - 8)
        with pytest.raises(gv.InvalidArgument):
            ini.write(a.mr, 2**64 - 1, 16, rb)
        assert ini.outstanding == 0
    with pytest.raises(gv.InvalidArgument):
        gv.RemoteMemory(b"garbage")
    with pytest.raises(gv.InvalidArgument):
        a.qp.connect(b"garbage")


def test_error_completions_are_their_exception_classes():
    # a bad rkey: REMOTE_ACCESS, both QPs in ERR, then flushes
    a, b = pair()
    good = b.mr.remote_memory()
    bad = gv.RemoteMemory(good)
    forged = gv.RemoteMemory(
        good.replace(str(bad.rkey).encode(), str(bad.rkey ^ 0x80).encode())
    )
    assert forged.rkey == bad.rkey ^ 0x80
    with a.qp.initiator() as ini:
        ini.write(a.mr, 0, 64, forged)
        with pytest.raises(gv.RemoteAccessError) as e:
            ini.wait_send()
        assert isinstance(e.value, gv.CompletionError)
        assert isinstance(e.value, gv.GpuverbsError)
        assert (e.value.syndrome, e.value.syndrome_code, e.value.responder) == (
            "RemoteAccess",
            0x13,
            False,
        )
        assert e.value.wqe_counter == 0 and e.value.qpn == a.qp.qpn
        assert a.qp.state == "ERR" and b.qp.state == "ERR"
        ini.write(a.mr, 0, 8, bad)
        with pytest.raises(gv.FlushError):
            ini.wait_send()
    # a bad lkey is not possible from Python (regions carry their keys): a local range past
    # the region is refused before posting (above); a SEND longer than the receive:
    a, b = pair()
    with a.qp.initiator() as ini, b.qp.initiator() as resp:
        resp.post_recv(b.mr, 0, 16)
        ini.send(a.mr, 0, 64)
        with pytest.raises(gv.RemoteInvalidRequestError):
            ini.wait_send()
        with pytest.raises(gv.LocalLengthError) as e:
            resp.wait_recv()
        assert e.value.responder is True
    # no receive and no RNR retries
    a, b = pair(rnr_retry=0)
    with a.qp.initiator() as ini:
        ini.send(a.mr, 0, 8)
        with pytest.raises(gv.RnrRetryError):
            ini.wait_send()
    # a peer that is gone
    a, b = pair(timeout=8, retry_cnt=1)
    rb = gv.RemoteMemory(b.mr.remote_memory())
    del b
    with a.qp.initiator() as ini:
        ini.write(a.mr, 0, 8, rb)
        with pytest.raises(gv.TransportRetryError):
            ini.wait_send()
    # nothing arrives: a timeout, not a hang
    a, b = pair()
    with a.qp.initiator() as ini:
        with pytest.raises(gv.CompletionTimeout):
            ini.wait_send(timeout=0.05)
        with pytest.raises(gv.InvalidArgument):
            ini.wait_send(timeout=-1.0)


def test_one_poster_at_a_time_and_qp_states():
    a, b = pair()
    ini = a.qp.initiator()
    with pytest.raises(gv.PosterBusyError):
        a.qp.initiator()
    ini.close()
    with pytest.raises(gv.InvalidArgument, match="closed"):
        ini.outstanding
    a.qp.initiator().close()
    side = Side(gv.Context("soft"))
    assert side.qp.state == "RESET"


def test_a_qp_recovers_after_an_error():
    a, b = pair()
    rb = gv.RemoteMemory(b.mr.remote_memory())
    forged = gv.RemoteMemory(
        b.mr.remote_memory().replace(str(rb.rkey).encode(), str(rb.rkey ^ 0x80).encode())
    )
    with b.qp.initiator() as resp:
        resp.post_recv(b.mr, 0, 64)
    with a.qp.initiator() as ini:
        ini.write(a.mr, 0, 8, forged)
        with pytest.raises(gv.RemoteAccessError):
            ini.wait_send()
    psn = a.qp.psn
    send, recv = a.qp.recover()
    assert (send, recv) == ([], [])
    bsend, brecv = b.qp.recover()
    assert [c.syndrome for c in brecv] == ["WrFlush"], brecv
    assert a.qp.state == "RESET" and a.qp.psn != psn
    a.qp.connect(b.qp.endpoint(), access=gv.ACCESS_REMOTE_WRITE)
    b.qp.connect(a.qp.endpoint(), access=gv.ACCESS_REMOTE_WRITE)
    with a.qp.initiator() as ini:
        a.buf[:512] = pattern(512, 3)
        ini.write(a.mr, 0, 512, rb)
        assert ini.wait_send().wqe_counter == 0
        assert np.array_equal(b.buf[:512], a.buf[:512])


def _peer(conn):
    """The second process: a wire soft NIC; endpoint and memory out, the peer's in; then
    checks what the first process wrote and answers."""
    s = Side(gv.Context("soft", wire="127.0.0.1:0"))
    conn.send((s.qp.endpoint(), s.mr.remote_memory()))
    ep = conn.recv()
    s.qp.connect(ep, access=gv.ACCESS_REMOTE_WRITE | gv.ACCESS_REMOTE_READ | gv.ACCESS_REMOTE_ATOMIC)
    conn.send("connected")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        n, seed, off = msg
        conn.send(bool(np.array_equal(s.buf[off : off + n], pattern(n, seed))))


def test_two_processes_write_read_and_atomics_over_the_wire():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_peer, args=(there,))
    p.start()
    try:
        a = Side(gv.Context("soft", wire="127.0.0.1:0"))
        ep_b, mem_b = here.recv()
        here.send(a.qp.endpoint())
        a.qp.connect(ep_b, access=0, timeout=16)
        assert here.recv() == "connected"
        rb = gv.RemoteMemory(mem_b)
        with a.qp.initiator() as ini:
            for i, (n, off) in enumerate([(8, 0), (4096, 100), (50000, 8192)]):
                a.buf[:n] = pattern(n, i)
                ini.write(a.mr, 0, n, rb, off)
                ini.wait_send()
                here.send((n, i, off))
                assert here.recv() is True, (n, off)
            # READ back what the peer holds
            ini.read(a.mr, 0, 4096, rb, 100)
            ini.wait_send()
            assert np.array_equal(a.buf[:4096], pattern(4096, 1))
            ini.fetch_add(a.mr, 8, rb, 65528, 5)
            ini.wait_send()
            ini.fetch_add(a.mr, 8, rb, 65528, 5)
            ini.wait_send()
            assert struct.unpack_from("<Q", a.buf, 8)[0] == 5
        here.send(None)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def test_include_dir_holds_the_device_api_headers():
    import os
    import pathlib
    import shutil
    import subprocess

    inc = pathlib.Path(gv.include_dir())
    assert inc == pathlib.Path(gv.include_dir())
    repo = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "include" / "gpuverbs"
    names = sorted(p.name for p in repo.iterdir() if p.suffix in (".cuh", ".h"))
    assert sorted(p.name for p in (inc / "gpuverbs").iterdir()) == names
    for n in names:
        assert (inc / "gpuverbs" / n).read_text() == (repo / n).read_text(), n
    # a kernel that includes them compiles, where nvcc is at hand (CI has the CUDA wheels)
    # the pinned CUDA wheels of `cargo xtask setup-cuda` (.cuda), else nvcc on the PATH
    wheels = sorted((repo.parents[2] / ".cuda").glob("lib/python3.*/site-packages/nvidia/cu13/bin/nvcc"))
    nvcc = os.environ.get("GPUVERBS_NVCC") or (str(wheels[-1]) if wheels else shutil.which("nvcc"))
    if nvcc is None:
        assert os.environ.get("GPUVERBS_REQUIRE_NVCC") != "1", "GPUVERBS_REQUIRE_NVCC=1 and no nvcc"
        pytest.skip("no nvcc to compile a kernel with")
    # the user-kernel sample's kernel (puts, quiet, statuses), against these headers only
    src = repo.parents[2] / "samples" / "user-kernel" / "kernels" / "user_put.cu"
    out = subprocess.run(
        [nvcc, "-std=c++17", "-arch=sm_90", "-I", str(inc), "-c", str(src), "-o", os.devnull],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
