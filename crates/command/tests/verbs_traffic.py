#!/usr/bin/python3
"""Byte-checked traffic through the real libibverbs + libmlx5 on the emulated devices.

Run under `gpuverbs emu --devices 2 -- /usr/bin/python3 verbs_traffic.py CASE...`: one process,
one context on each of mlx5_0 and mlx5_1, RC QPs between them. Every case checks each byte it
moved (or old value it fetched) and the completion status a ConnectX gives for its error
cases; asynchronous events are read with ibv_get_async_event. Prints `PASS <case>` per case and
exits non-zero on the first failure. A watchdog alarm bounds the whole run.
"""

import os
import random
import signal
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR, MW, MWBind, MWBindInfo
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

ACCESS = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE |
          e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC)
MR_SIZE = 1 << 17


def fail(msg):
    print(f'FAIL {msg}', flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def rand_bytes(n):
    return bytes(random.getrandbits(8) for _ in range(n))


class Side:
    """One device's context, PD, CQ and MR."""

    def __init__(self, name, cqe=256, srq=False):
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, cqe, None, None, 0)
        self.mr = MR(self.pd, MR_SIZE, ACCESS)
        self.gid = self.ctx.query_gid(1, 0)
        self.srq = SRQ(self.pd, SrqInitAttr(SrqAttr(max_wr=64, max_sge=2))) if srq else None

    def qp(self, max_send_wr=64):
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=0 if self.srq else 64,
                    max_send_sge=4, max_recv_sge=0 if self.srq else 4)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                          srq=self.srq, cap=cap)
        attr = QPAttr(port_num=1)
        attr.qp_access_flags = ACCESS & ~e.IBV_ACCESS_LOCAL_WRITE
        return QP(self.pd, init, attr)

    def poll(self, n, limit=10.0):
        """n completions, or fail after `limit` seconds."""
        got = []
        t = time.monotonic()
        while len(got) < n:
            k, wcs = self.cq.poll(num_entries=n - len(got))
            got.extend(wcs[:k])
            if k == 0:
                if time.monotonic() - t > limit:
                    fail(f'only {len(got)} of {n} completions in {limit} s')
                time.sleep(0.0005)
        return got

    def quiet(self, wait=0.2):
        """No completion arrives within `wait` seconds."""
        time.sleep(wait)
        k, _ = self.cq.poll(num_entries=1)
        check(k == 0, 'unexpected completion')

    def event(self, want, what):
        """The next async event of this context is `want` (blocking; the alarm bounds it)."""
        ev = self.ctx.get_async_event()
        t = ev.event_type
        ev.ack()
        check(t == want, f'{what}: async event {t}, expected {want}')


def connect(a, qa, b, qb, timeout=14, retry_cnt=7, rnr_retry=7, min_rnr_timer=1):
    for (me, q, peer, pq) in ((a, qa, b, qb), (b, qb, a, qa)):
        attr = QPAttr(port_num=1)
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = pq.qp_num
        attr.rq_psn = 0
        attr.sq_psn = 0
        attr.max_dest_rd_atomic = 4
        attr.max_rd_atomic = 4
        attr.min_rnr_timer = min_rnr_timer
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        attr.ah_attr = AHAttr(port_num=1, is_global=1,
                              gr=GlobalRoute(dgid=peer.gid, sgid_index=0))
        q.to_rts(attr)


def send_wr(opcode, side, off, length, wr_id=1, imm=None, lkey=None):
    sge = SGE(side.mr.buf + off, length, side.mr.lkey if lkey is None else lkey)
    kw = {}
    if imm is not None:
        kw['imm_data'] = imm
    return SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge],
                  send_flags=e.IBV_SEND_SIGNALED, **kw)


def recv_wr(side, off, length, wr_id=1):
    return RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(side.mr.buf + off, length, side.mr.lkey)])


def ok(wc, what, opcode=None):
    check(wc.status == e.IBV_WC_SUCCESS, f'{what}: status {wc.status}')
    if opcode is not None:
        check(wc.opcode == opcode, f'{what}: opcode {wc.opcode}, expected {opcode}')


def pair(**kw):
    a, b = Side('mlx5_0'), Side('mlx5_1')
    qa, qb = a.qp(), b.qp()
    connect(a, qa, b, qb, **kw)
    return a, qa, b, qb


def case_traffic():
    a, qa, b, qb = pair()
    # WRITE and READ of several sizes, every byte checked
    for n, off in ((1, 0), (63, 5), (4096, 4096), (65536, 8192)):
        data = rand_bytes(n)
        a.mr.write(data, n, off)
        wr = send_wr(e.IBV_WR_RDMA_WRITE, a, off, n)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + off + 3)
        qa.post_send(wr)
        ok(a.poll(1)[0], f'WRITE {n}', e.IBV_WC_RDMA_WRITE)
        check(b.mr.read(n, off + 3) == data, f'WRITE {n}: bytes differ')
        back = rand_bytes(n)
        b.mr.write(back, n, off + 7)
        wr = send_wr(e.IBV_WR_RDMA_READ, a, off + 1, n)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + off + 7)
        qa.post_send(wr)
        wc = a.poll(1)[0]
        ok(wc, f'READ {n}', e.IBV_WC_RDMA_READ)
        check(wc.byte_len == n, f'READ {n}: byte_len {wc.byte_len}')
        check(a.mr.read(n, off + 1) == back, f'READ {n}: bytes differ')
    # SEND/RECV, one and two scatter entries on the receiver
    for n in (0, 1, 100, 1024, 3000, 16384):
        data = rand_bytes(n)
        a.mr.write(data or b'\0', max(n, 1), 0)
        qb.post_recv(recv_wr(b, 32768, 20000, wr_id=n + 10))
        qa.post_send(send_wr(e.IBV_WR_SEND, a, 0, n, wr_id=n))
        ok(a.poll(1)[0], f'SEND {n}', e.IBV_WC_SEND)
        wc = b.poll(1)[0]
        ok(wc, f'RECV {n}', e.IBV_WC_RECV)
        check(wc.byte_len == n and wc.wr_id == n + 10, f'RECV {n}: len {wc.byte_len}')
        check(b.mr.read(n, 32768) == data if n else True, f'RECV {n}: bytes differ')
    data = rand_bytes(3000)
    a.mr.write(data, 3000, 0)
    sg = [SGE(b.mr.buf + 40000, 1000, b.mr.lkey), SGE(b.mr.buf + 50000, 2000, b.mr.lkey)]
    qb.post_recv(RecvWR(wr_id=77, num_sge=2, sg=sg))
    qa.post_send(send_wr(e.IBV_WR_SEND, a, 0, 3000))
    ok(a.poll(1)[0], 'SEND 2 SGEs')
    ok(b.poll(1)[0], 'RECV 2 SGEs', e.IBV_WC_RECV)
    check(b.mr.read(1000, 40000) + b.mr.read(2000, 50000) == data, 'RECV 2 SGEs: bytes')
    # WRITE_IMM: the bytes land at the address, the immediate in the receive completion
    for n in (0, 8, 5000):
        data = rand_bytes(n)
        if n:
            a.mr.write(data, n, 100)
        qb.post_recv(recv_wr(b, 0, 16, wr_id=500 + n))
        wr = send_wr(e.IBV_WR_RDMA_WRITE_WITH_IMM, a, 100, n, imm=0x1234abcd + n)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 70000)
        qa.post_send(wr)
        ok(a.poll(1)[0], f'WRITE_IMM {n}', e.IBV_WC_RDMA_WRITE)
        wc = b.poll(1)[0]
        ok(wc, f'WRITE_IMM {n} receive', e.IBV_WC_RECV_RDMA_WITH_IMM)
        check(wc.imm_data == 0x1234abcd + n, f'WRITE_IMM imm {wc.imm_data:#x}')
        check(wc.byte_len == n, f'WRITE_IMM byte_len {wc.byte_len}')
        check(wc.wr_id == 500 + n, 'WRITE_IMM wr_id')
        if n:
            check(b.mr.read(n, 70000) == data, f'WRITE_IMM {n}: bytes differ')
    # atomics: old values and results
    target = 90000
    v = random.getrandbits(64)
    b.mr.write(v.to_bytes(8, 'little'), 8, target)
    add = random.getrandbits(32)
    wr = send_wr(e.IBV_WR_ATOMIC_FETCH_AND_ADD, a, 200, 8)
    wr.set_wr_atomic(rkey=b.mr.rkey, addr=b.mr.buf + target, compare_add=add, swap=0)
    qa.post_send(wr)
    ok(a.poll(1)[0], 'FETCH_ADD', e.IBV_WC_FETCH_ADD)
    check(int.from_bytes(a.mr.read(8, 200), 'little') == v, 'FETCH_ADD old value')
    now = (v + add) % (1 << 64)
    check(int.from_bytes(b.mr.read(8, target), 'little') == now, 'FETCH_ADD result')
    for compare, swapped in ((now, True), (now ^ 1, False)):
        new = random.getrandbits(64)
        before = int.from_bytes(b.mr.read(8, target), 'little')
        wr = send_wr(e.IBV_WR_ATOMIC_CMP_AND_SWP, a, 208, 8)
        wr.set_wr_atomic(rkey=b.mr.rkey, addr=b.mr.buf + target, compare_add=compare, swap=new)
        qa.post_send(wr)
        ok(a.poll(1)[0], 'CMP_SWP', e.IBV_WC_COMP_SWAP)
        check(int.from_bytes(a.mr.read(8, 208), 'little') == before, 'CMP_SWP old value')
        after = int.from_bytes(b.mr.read(8, target), 'little')
        check(after == (new if swapped else before), f'CMP_SWP swapped={swapped}')
    # a burst of WRITEs, each to its own range, completions in order
    datas = []
    for i in range(32):
        d = rand_bytes(512)
        datas.append(d)
        a.mr.write(d, 512, i * 512)
        wr = send_wr(e.IBV_WR_RDMA_WRITE, a, i * 512, 512, wr_id=i)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 65536 + i * 512)
        qa.post_send(wr)
    wcs = a.poll(32)
    check([w.wr_id for w in wcs] == list(range(32)), 'burst completions in order')
    for i, d in enumerate(datas):
        check(b.mr.read(512, 65536 + i * 512) == d, f'burst WRITE {i}')


def case_errors():
    # bad rkey: the requester gets REM_ACCESS_ERR, the responder QP an access error event
    a, qa, b, qb = pair()
    wr = send_wr(e.IBV_WR_RDMA_WRITE, a, 0, 64)
    wr.set_wr_rdma(b.mr.rkey ^ 0x5500, b.mr.buf)
    qa.post_send(wr)
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_REM_ACCESS_ERR, f'bad rkey: status {wc.status}')
    b.event(e.IBV_EVENT_QP_ACCESS_ERR, 'bad rkey at the responder')
    # the QP is in ERR now: a later WQE flushes
    wr = send_wr(e.IBV_WR_RDMA_WRITE, a, 0, 64, wr_id=2)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
    qa.post_send(wr)
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_WR_FLUSH_ERR and wc.wr_id == 2, f'after error: {wc.status}')
    # READ beyond the region: REM_ACCESS_ERR
    a, qa, b, qb = pair()
    wr = send_wr(e.IBV_WR_RDMA_READ, a, 0, 64)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf + MR_SIZE - 32)
    qa.post_send(wr)
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_REM_ACCESS_ERR, f'READ out of range: status {wc.status}')
    b.event(e.IBV_EVENT_QP_ACCESS_ERR, 'READ out of range at the responder')
    # bad lkey: LOC_PROT_ERR, nothing reaches the peer
    a, qa, b, qb = pair()
    wr = send_wr(e.IBV_WR_RDMA_WRITE, a, 0, 64, lkey=a.mr.lkey ^ 0x7700)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
    qa.post_send(wr)
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_LOC_PROT_ERR, f'bad lkey: status {wc.status}')
    # SEND longer than the receive buffer: REM_INV_REQ_ERR, the receive LOC_LEN_ERR
    a, qa, b, qb = pair()
    qb.post_recv(recv_wr(b, 0, 100, wr_id=9))
    qa.post_send(send_wr(e.IBV_WR_SEND, a, 0, 200))
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_REM_INV_REQ_ERR, f'long SEND: status {wc.status}')
    wc = b.poll(1)[0]
    check(wc.status == e.IBV_WC_LOC_LEN_ERR and wc.wr_id == 9, f'short RECV: {wc.status}')
    # no receive posted and no RNR retries: RNR_RETRY_EXC_ERR
    a, qa, b, qb = pair(rnr_retry=0)
    qa.post_send(send_wr(e.IBV_WR_SEND, a, 0, 8))
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_RNR_RETRY_EXC_ERR, f'no receive: status {wc.status}')
    # QP not ready: a QP moved to ERR flushes what is posted, sends and receives
    a, qa, b, qb = pair()
    qb.post_recv(recv_wr(b, 0, 100, wr_id=31))
    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_ERR
    qb.modify(attr, e.IBV_QP_STATE)
    wc = b.poll(1)[0]
    check(wc.status == e.IBV_WC_WR_FLUSH_ERR and wc.wr_id == 31, f'RECV in ERR: {wc.status}')
    wr = send_wr(e.IBV_WR_RDMA_WRITE, b, 0, 8, wr_id=32)
    wr.set_wr_rdma(a.mr.rkey, a.mr.buf)
    qb.post_send(wr)
    wc = b.poll(1)[0]
    check(wc.status == e.IBV_WC_WR_FLUSH_ERR and wc.wr_id == 32, f'SEND in ERR: {wc.status}')
    # and the peer of a QP in ERR gets no answer: retries run out (short timeout)
    a2, qa2, b2, qb2 = pair(timeout=8, retry_cnt=1)
    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_ERR
    qb2.modify(attr, e.IBV_QP_STATE)
    wr = send_wr(e.IBV_WR_RDMA_WRITE, a2, 0, 8)
    wr.set_wr_rdma(b2.mr.rkey, b2.mr.buf)
    qa2.post_send(wr)
    wc = a2.poll(1, limit=20)[0]
    check(wc.status == e.IBV_WC_RETRY_EXC_ERR, f'peer in ERR: status {wc.status}')


def case_srq():
    a = Side('mlx5_0')
    b = Side('mlx5_1', srq=True)
    qas = [a.qp(), a.qp()]
    qbs = [b.qp(), b.qp()]
    for qa, qb in zip(qas, qbs):
        connect(a, qa, b, qb)
    attr = b.srq.query()
    check(attr.max_wr >= 64 and attr.max_sge >= 2, f'SRQ caps {attr.max_wr} {attr.max_sge}')
    slot = 2048

    def post(i):
        b.srq.post_recv(RecvWR(wr_id=i, num_sge=1,
                               sg=[SGE(b.mr.buf + (i % 64) * slot, slot, b.mr.lkey)]))

    for i in range(64):
        post(i)
    # 200 SENDs from two QPs into the one SRQ: more than its ring, so freed WQEs are reused
    sent = {}
    nxt = 64
    for k in range(200):
        n = random.randint(1, slot)
        d = rand_bytes(n)
        a.mr.write(d, n, 0)
        q = qas[k % 2]
        q.post_send(send_wr(e.IBV_WR_SEND, a, 0, n, wr_id=k))
        ok(a.poll(1)[0], f'SRQ SEND {k}')
        wc = b.poll(1)[0]
        ok(wc, f'SRQ RECV {k}', e.IBV_WC_RECV)
        check(wc.qp_num == qbs[k % 2].qp_num, f'SRQ RECV {k}: QP {wc.qp_num}')
        check(wc.byte_len == n, f'SRQ RECV {k}: byte_len {wc.byte_len}')
        check(wc.wr_id not in sent, f'SRQ WQE {wc.wr_id} used twice')
        check(b.mr.read(n, (wc.wr_id % 64) * slot) == d, f'SRQ RECV {k}: bytes differ')
        sent[wc.wr_id] = k
        post(nxt)
        nxt += 1
    check(sorted(sent) == list(range(200)), 'SRQ WQEs taken in posted order')
    # WRITE_IMM takes a WQE from the SRQ too
    qb_imm = qas[0]
    wr = send_wr(e.IBV_WR_RDMA_WRITE_WITH_IMM, a, 0, 16, imm=0x55667788)
    wr.set_wr_rdma(b.mr.rkey, b.mr.buf + 65536 * 3 // 2)
    qb_imm.post_send(wr)
    ok(a.poll(1)[0], 'SRQ WRITE_IMM')
    wc = b.poll(1)[0]
    ok(wc, 'SRQ WRITE_IMM receive', e.IBV_WC_RECV_RDMA_WITH_IMM)
    check(wc.wr_id == 200, f'SRQ WRITE_IMM wr_id {wc.wr_id}')
    # the limit event: armed at 60 with 63 posted, it fires when fewer than 60 remain
    b.srq.modify(SrqAttr(srq_limit=60), e.IBV_SRQ_LIMIT)
    check(b.srq.query().srq_limit == 60, 'SRQ limit armed')
    for k in range(4):
        qas[0].post_send(send_wr(e.IBV_WR_SEND, a, 0, 8))
        ok(a.poll(1)[0], 'SRQ limit SEND')
        ok(b.poll(1)[0], 'SRQ limit RECV')
    b.event(e.IBV_EVENT_SRQ_LIMIT_REACHED, 'SRQ limit')
    check(b.srq.query().srq_limit == 0, 'SRQ limit disarmed after its event')
    # a QP on the SRQ moved to ERR: LAST_WQE_REACHED; the SRQ's WQEs stay for the other QP
    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_ERR
    qbs[0].modify(attr, e.IBV_QP_STATE)
    b.event(e.IBV_EVENT_QP_LAST_WQE_REACHED, 'QP on SRQ to ERR')
    b.quiet()
    qas[1].post_send(send_wr(e.IBV_WR_SEND, a, 0, 8))
    ok(a.poll(1)[0], 'SEND after LAST_WQE')
    wc = b.poll(1)[0]
    ok(wc, 'RECV after LAST_WQE')
    check(wc.qp_num == qbs[1].qp_num, 'RECV after LAST_WQE on the other QP')
    # no receive left on the SRQ: RNR
    a3, qa3 = a, a.qp()
    c = Side('mlx5_1', srq=True)
    qc = c.qp()
    connect(a3, qa3, c, qc, rnr_retry=0)
    qa3.post_send(send_wr(e.IBV_WR_SEND, a3, 0, 8))
    wc = a3.poll(1)[0]
    check(wc.status == e.IBV_WC_RNR_RETRY_EXC_ERR, f'empty SRQ: status {wc.status}')


def case_resize():
    a = Side('mlx5_0', cqe=3)
    b = Side('mlx5_1')
    qa, qb = a.qp(max_send_wr=32), b.qp()
    connect(a, qa, b, qb)
    check(a.cq.cqe == 3, f'CQ cqe {a.cq.cqe}')

    def writes(first, n):
        for i in range(first, first + n):
            wr = send_wr(e.IBV_WR_RDMA_WRITE, a, i * 8, 8, wr_id=i)
            wr.set_wr_rdma(b.mr.rkey, b.mr.buf + i * 8)
            qa.post_send(wr)

    # three completions wait in the old ring; they must come out of the new one in order
    writes(0, 3)
    time.sleep(0.2)
    a.cq.resize(15)
    check(a.cq.cqe == 15, f'resized CQ cqe {a.cq.cqe}')
    check([w.wr_id for w in a.poll(3)] == [0, 1, 2], 'CQEs carried over the resize')
    writes(3, 12)
    check([w.wr_id for w in a.poll(12)] == list(range(3, 15)), 'CQEs after the resize')
    # a size that cannot hold the completions not yet polled is refused, the CQ keeps working
    writes(15, 10)
    time.sleep(0.2)
    try:
        a.cq.resize(3)
        fail('resize below the pending completions succeeded')
    except PyverbsRDMAError as ex:
        check(ex.error_code == 22, f'resize below pending: errno {ex.error_code}')
    check([w.wr_id for w in a.poll(10)] == list(range(15, 25)), 'CQEs after a refused resize')
    # smaller again, then traffic through several laps of the small ring
    a.cq.resize(7)
    check(a.cq.cqe == 7, f'shrunk CQ cqe {a.cq.cqe}')
    for lap in range(6):
        writes(100 + lap * 5, 5)
        check([w.wr_id for w in a.poll(5)] == list(range(100 + lap * 5, 105 + lap * 5)),
              f'lap {lap} after the shrink')


def case_async():
    # a CQ overrun: CQ_ERR on the CQ and QP_FATAL on the QP writing to it
    a = Side('mlx5_0', cqe=1)
    b = Side('mlx5_1')
    qa, qb = a.qp(), b.qp()
    connect(a, qa, b, qb)
    n = a.cq.cqe + 2
    for i in range(n):
        wr = send_wr(e.IBV_WR_RDMA_WRITE, a, 0, 8, wr_id=i)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
        qa.post_send(wr)
    got = set()
    for _ in range(2):
        ev = a.ctx.get_async_event()
        got.add(ev.event_type)
        ev.ack()
    check(got == {e.IBV_EVENT_CQ_ERR, e.IBV_EVENT_QP_FATAL}, f'overrun events {got}')
    # the QP is in ERR; destroying it and the CQ after the acknowledged events returns
    qa.close()
    a.cq.close()


def case_windows():
    """Memory windows through libmlx5's own UMR WQEs: a type 1 window bound with ibv_bind_mw
    and a type 2 window bound with IBV_WR_BIND_MW carry byte-checked WRITEs and READs at
    their place in the region; SEND_WITH_INV of the type 2 key invalidates it (the receive
    reports IBV_WC_WITH_INV and the key); refused binds complete with IBV_WC_MW_BIND_ERR; an
    unknown SEND_WITH_INV key is IBV_WC_REM_INV_REQ_ERR."""
    a, qa, b, qb = pair()
    wmr = MR(b.pd, MR_SIZE, ACCESS | e.IBV_ACCESS_MW_BIND)
    rw = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    # type 1: 4 KiB at 8 KiB into the region
    mw1 = MW(b.pd, e.IBV_MW_TYPE_1)
    qb.bind_mw(mw1, MWBind(MWBindInfo(wmr, wmr.buf + 8192, 4096, rw), e.IBV_SEND_SIGNALED))
    wc = b.poll(1)[0]
    ok(wc, 'type 1 bind', e.IBV_WC_BIND_MW)
    data = rand_bytes(1000)
    a.mr.write(data, len(data), 0)
    wr = send_wr(e.IBV_WR_RDMA_WRITE, a, 0, len(data))
    wr.set_wr_rdma(mw1.rkey, wmr.buf + 8192 + 500)
    qa.post_send(wr)
    ok(a.poll(1)[0], 'WRITE through a type 1 window')
    check(wmr.read(len(data), 8192 + 500) == data, 'type 1 window: bytes')
    # type 2, bound to qb: a READ through it
    mw2 = MW(b.pd, e.IBV_MW_TYPE_2)
    bind = SendWR(opcode=e.IBV_WR_BIND_MW, send_flags=e.IBV_SEND_SIGNALED)
    bind.set_bind_wr(mw2, MWBindInfo(wmr, wmr.buf, 4096, rw))
    qb.post_send(bind)
    ok(b.poll(1)[0], 'type 2 bind', e.IBV_WC_BIND_MW)
    key2 = bind.rkey
    data = rand_bytes(3000)
    wmr.write(data, len(data), 64)
    wr = send_wr(e.IBV_WR_RDMA_READ, a, 4096, len(data))
    wr.set_wr_rdma(key2, wmr.buf + 64)
    qa.post_send(wr)
    ok(a.poll(1)[0], 'READ through a type 2 window')
    check(a.mr.read(len(data), 4096) == data, 'type 2 window: bytes')
    # SEND_WITH_INV of the type 2 key
    qb.post_recv(recv_wr(b, 0, 64, wr_id=41))
    wr = send_wr(e.IBV_WR_SEND_WITH_INV, a, 0, 16)
    wr.imm_data = key2
    qa.post_send(wr)
    ok(a.poll(1)[0], 'SEND_WITH_INV')
    wc = b.poll(1)[0]
    ok(wc, 'SEND_WITH_INV receive', e.IBV_WC_RECV)
    check(wc.wc_flags & e.IBV_WC_WITH_INV, f'receive flags {wc.wc_flags}')
    # ibv_wc's invalidated_rkey shares imm_data's place (pyverbs names only the latter)
    check(wc.imm_data == key2, f'invalidated rkey {wc.imm_data:#x}, expected {key2:#x}')
    # the type 1 window still works, the type 2 key is dead (and the responder QP fails)
    wr = send_wr(e.IBV_WR_RDMA_WRITE, a, 0, 8)
    wr.set_wr_rdma(mw1.rkey, wmr.buf + 8192)
    qa.post_send(wr)
    ok(a.poll(1)[0], 'type 1 window after the invalidation')
    wr = send_wr(e.IBV_WR_RDMA_WRITE, a, 0, 8)
    wr.set_wr_rdma(key2, wmr.buf)
    qa.post_send(wr)
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_REM_ACCESS_ERR, f'invalidated key: status {wc.status}')
    # a bind over a region registered without MW_BIND: MW_BIND_ERR
    a, qa, b, qb = pair()
    mw = MW(b.pd, e.IBV_MW_TYPE_2)
    bind = SendWR(opcode=e.IBV_WR_BIND_MW, send_flags=e.IBV_SEND_SIGNALED)
    bind.set_bind_wr(mw, MWBindInfo(b.mr, b.mr.buf, 4096, rw))
    qb.post_send(bind)
    wc = b.poll(1)[0]
    check(wc.status == e.IBV_WC_MW_BIND_ERR, f'bind without MW_BIND: status {wc.status}')
    # SEND_WITH_INV of a key that is no window of the responder's QP
    a, qa, b, qb = pair()
    qb.post_recv(recv_wr(b, 0, 64, wr_id=42))
    wr = send_wr(e.IBV_WR_SEND_WITH_INV, a, 0, 16)
    wr.imm_data = b.mr.rkey
    qa.post_send(wr)
    wc = a.poll(1)[0]
    check(wc.status == e.IBV_WC_REM_INV_REQ_ERR, f'foreign SEND_WITH_INV: status {wc.status}')
    wc = b.poll(1)[0]
    check(wc.status == e.IBV_WC_LOC_PROT_ERR and wc.wr_id == 42, f'its receive: {wc.status}')
    for m in (mw1, mw2, mw):
        m.close()


CASES = {
    'traffic': case_traffic,
    'errors': case_errors,
    'srq': case_srq,
    'resize': case_resize,
    'async': case_async,
    'windows': case_windows,
}

if __name__ == '__main__':
    signal.alarm(int(os.environ.get('VERBS_TRAFFIC_LIMIT', '120')))
    random.seed(int(os.environ.get('VERBS_TRAFFIC_SEED', '7')))
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
        print(f'PASS {name}', flush=True)
