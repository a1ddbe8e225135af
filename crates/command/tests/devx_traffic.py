#!/usr/bin/python3
"""DEVX on the emulated devices, through the real libmlx5 and pyverbs: queries, umems, UARs,
CQs and RC QPs made with PRM commands, and byte-checked traffic whose WQEs this script writes
into umem rings and rings on UAR pages itself, as GPU-initiated libraries do.

Run under `gpuverbs emu --devices 2 -- /usr/bin/python3 devx_traffic.py TESTS_DIR CASE...`, where
TESTS_DIR holds rdma-core's unpacked `tests` package (its `mlx5_prm_structs` lays out the
mailboxes, independently of gpuverbs' own tables). One process, a DEVX context on each of
mlx5_0 and mlx5_1. Prints `PASS <case>` per case and exits non-zero on the first failure; a
watchdog alarm bounds the run.
"""

import ctypes
import errno
import importlib.util
import mmap
import os
import random
import signal
import struct
import sys
import time

import pyverbs.enums as e  # noqa: E402
import pyverbs.providers.mlx5.mlx5_enums as dve  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR  # noqa: E402
from pyverbs.providers.mlx5.mlx5dv import (Mlx5Context, Mlx5DevxObj,  # noqa: E402
                                           Mlx5DVContextAttr, Mlx5UAR, Mlx5UMEM)
from pyverbs.providers.mlx5.mlx5dv_objects import Mlx5DvObj  # noqa: E402
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError  # noqa: E402

# rdma-core's scapy description of the PRM structures, loaded on its own (the `tests` package
# would import every test module)
_spec = importlib.util.spec_from_file_location(
    'mlx5_prm_structs', os.path.join(sys.argv[1], 'tests', 'mlx5_prm_structs.py'))
prm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prm)
CreateCqIn, CreateCqOut, SwCqc = prm.CreateCqIn, prm.CreateCqOut, prm.SwCqc
CreateQpIn, CreateQpOut, SwQpc, DevxOps = prm.CreateQpIn, prm.CreateQpOut, prm.SwQpc, prm.DevxOps
ModifyQpIn, ModifyQpOut, QueryQpIn, QueryQpOut = (prm.ModifyQpIn, prm.ModifyQpOut,
                                                  prm.QueryQpIn, prm.QueryQpOut)
QueryCmdHcaCapOut, QueryHcaCapIn = prm.QueryCmdHcaCapOut, prm.QueryHcaCapIn
QueryHcaVportContextIn, QueryHcaVportContextOut = (prm.QueryHcaVportContextIn,
                                                   prm.QueryHcaVportContextOut)

MR_SIZE = 1 << 16
ACCESS = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE |
          e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC)
EREMOTEIO = 121

# mlx5 WQE and CQE opcodes
OP_WRITE, OP_WRITE_IMM, OP_SEND, OP_SEND_IMM, OP_READ, OP_CS, OP_FA = 0x08, 0x09, 0x0a, 0x0b, 0x10, 0x11, 0x12
OP_WAIT = 0x0f
CQE_REQ, CQE_RESP_WRITE_IMM, CQE_RESP_SEND, CQE_RESP_SEND_IMM = 0, 1, 2, 3
CQE_REQ_ERR, CQE_RESP_ERR, CQE_INVALID = 13, 14, 15


def fail(msg):
    print(f'FAIL {msg}', flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def expect_errno(want, what, f):
    """Runs f; it must fail with errno `want`."""
    try:
        f()
    except PyverbsRDMAError as ex:
        check(ex.error_code == want, f'{what}: errno {ex.error_code}, want {want}')
        return
    except PyverbsError as ex:
        # some pyverbs objects report a failed close without an error code
        check(f'Errno: {want},' in str(ex), f'{what}: {ex}, want errno {want}')
        return
    fail(f'{what}: succeeded, want errno {want}')


def peek(addr, n):
    return ctypes.string_at(addr, n)


def poke(addr, data):
    ctypes.memmove(addr, data, len(data))


def store64(addr, data8):
    """One 8-byte store of these bytes (a doorbell)."""
    ctypes.c_uint64.from_address(addr).value = int.from_bytes(data8, 'little')


def be32_at(addr, off, v):
    poke(addr + off, struct.pack('>I', v & 0xffffffff))


def bits(buf, bit, width):
    """A PRM field: `width` bits at bit offset `bit` (MSB first) of `buf`."""
    v = int.from_bytes(buf, 'big')
    return (v >> (len(buf) * 8 - bit - width)) & ((1 << width) - 1)


DEVS = []


def put_bits(buf, bit, width, v):
    """Sets a PRM field: `width` bits at bit offset `bit` (MSB first) of bytearray `buf`."""
    n = int.from_bytes(buf, 'big')
    shift = len(buf) * 8 - bit - width
    n = n & ~(((1 << width) - 1) << shift) | (v & ((1 << width) - 1)) << shift
    buf[:] = n.to_bytes(len(buf), 'big')


def gid_words(gid):
    """A GID as the four big-endian words of an address path's `rgid_rip`."""
    return list(struct.unpack('>IIII', gid))


class Dev:
    """A DEVX context with a PD, an MR, its EQ and one NC UAR page."""

    def __init__(self, name):
        self.ctx = Mlx5Context(Mlx5DVContextAttr(dve.MLX5DV_CONTEXT_FLAGS_DEVX), name)
        self.pd = PD(self.ctx)
        self.pdn = Mlx5DvObj(dve.MLX5DV_OBJ_PD, pd=self.pd).dvpd.pdn
        self.mr = MR(self.pd, MR_SIZE, ACCESS)
        self.eqn = self.ctx.devx_query_eqn(0)
        self.uar = Mlx5UAR(self.ctx, dve._MLX5DV_UAR_ALLOC_TYPE_NC)
        check(self.uar.page_id != 0, 'NC UAR page id 0')
        gid = self.ctx.query_gid(1, 0)
        self.gid = bytes.fromhex(str(gid).replace(':', ''))
        self.owned = []
        DEVS.append(self)

    def own(self, obj):
        """Keeps `obj` to close before the context (pyverbs may free a context before the
        objects made on it when the interpreter tears down)."""
        self.owned.append(obj)
        return obj

    def close(self):
        for o in reversed(self.owned):
            o.close()
        for o in (self.uar, self.mr, self.pd, self.ctx):
            o.close()

    def umem(self, size, align=4096, access=e.IBV_ACCESS_LOCAL_WRITE):
        return self.own(Mlx5UMEM(self.ctx, size=size, alignment=align, access=access))

    def cmd(self, cmd_in, outlen):
        return self.ctx.devx_general_cmd(cmd_in, outlen)


class Cq:
    """A DEVX CQ in a umem: regular, overrun-ignore or collapsed; 64-byte entries (cqe_sz 0)
    or 128-byte ones (cqe_sz 1: the 64-byte CQE is each entry's second half)."""

    def __init__(self, dev, log_size=6, cc=0, oi=0, cqe_sz=0):
        self.n = 1 << log_size
        self.cc = cc
        self.stride = 64 << cqe_sz
        self.ring = dev.umem(max(4096, self.n * self.stride))
        self.dbr = dev.umem(8, align=8)
        # the device writes a CQ ring only with CQEs: mark every entry invalid (opcode 0xF), as
        # libmlx5, DOCA and NVSHMEM do (a zeroed entry looks like a REQ CQE of the first lap)
        poke(self.ring.umem_addr, (bytes(self.stride - 1) + b'\xf0') * self.n)
        poke(self.dbr.umem_addr, bytes(8))
        cmd_in = CreateCqIn(cq_umem_valid=1, cq_umem_id=self.ring.umem_id,
                            sw_cqc=SwCqc(c_eqn=dev.eqn, uar_page=dev.uar.page_id,
                                         log_cq_size=log_size, cc=cc, oi=oi, cqe_sz=cqe_sz,
                                         dbr_umem_valid=1, dbr_umem_id=self.dbr.umem_id))
        self.obj = dev.own(Mlx5DevxObj(dev.ctx, cmd_in, len(CreateCqOut())))
        self.cqn = CreateCqOut(self.obj.out_view).cqn
        self.ci = 0

    def entry(self, i):
        return peek(self.ring.umem_addr + (i % self.n) * self.stride + self.stride - 64, 64)

    def first_half(self, i):
        """The first 64 bytes of a 128-byte entry (inline scatter, which the device does not
        do: never written)."""
        return peek(self.ring.umem_addr + (i % self.n) * self.stride, 64)

    def poll(self, limit=10.0):
        """The next CQE (bytes) of a regular CQ; the consumer index moves on."""
        owner = (self.ci // self.n) & 1
        t = time.monotonic()
        while True:
            c = self.entry(self.ci)
            op_own = c[63]
            if op_own >> 4 != CQE_INVALID and (op_own & 1) == owner:
                break
            if time.monotonic() - t > limit:
                fail(f'CQ {self.cqn:#x}: no CQE {self.ci} in {limit} s')
        self.ci += 1
        be32_at(self.dbr.umem_addr, 0, self.ci & 0xffffff)
        return c

    def close(self):
        self.obj.close()
        self.ring.close()
        self.dbr.close()


def opcode(c):
    return c[63] >> 4


def wqe_counter(c):
    return struct.unpack('>H', c[60:62])[0]


class Qp:
    """A DEVX RC QP: RQ (16-byte WQEs, one SGE) then SQ in one umem, the doorbell record in
    another, doorbells on the device's NC UAR page."""

    def __init__(self, dev, scq, rcq, log_sq=6, log_rq=6, rq_type=0, st=None, no_dbr=False,
                 cd_master=0):
        self.dev = dev
        self.sq_n, self.rq_n = 1 << log_sq, (1 << log_rq if rq_type == 0 else 0)
        self.rq_bytes = self.rq_n * 16
        self.wq = dev.umem(max(4096, self.rq_bytes + self.sq_n * 64))
        self.dbr = dev.umem(8, align=8)
        qpc = SwQpc(st=DevxOps.MLX5_QPC_ST_RC if st is None else st, pd=dev.pdn,
                    pm_state=DevxOps.MLX5_QPC_PM_STATE_MIGRATED,
                    log_sq_size=log_sq, log_rq_size=log_rq if rq_type == 0 else 0,
                    log_rq_stride=0, rq_type=rq_type, uar_page=dev.uar.page_id,
                    cqn_snd=scq.cqn, cqn_rcv=rcq.cqn, dbr_umem_id=self.dbr.umem_id,
                    dbr_umem_valid=1, cd_master=cd_master)
        cmd_in = bytearray(bytes(CreateQpIn(sw_qpc=qpc, wq_umem_id=self.wq.umem_id,
                                            wq_umem_valid=1)))
        # qpc.send_dbr_mode (bit 0x80 of the context at byte 24): 1 = NO_DBR_EXT, rung at the
        # page's DBR-less register (0x600) with no send doorbell record
        self.no_dbr = no_dbr
        put_bits(cmd_in, 24 * 8 + 0x80, 2, 1 if no_dbr else 0)
        self.db = (dev.uar.reg_addr & ~0xfff) + 0x600 if no_dbr else dev.uar.reg_addr
        self.obj = dev.own(Mlx5DevxObj(dev.ctx, bytes(cmd_in), len(CreateQpOut())))
        self.qpn = CreateQpOut(self.obj.out_view).qpn
        self.pi = 0
        self.rq_head = 0
        self.psn = random.getrandbits(24)

    def modify(self, op, qpc, opt=0):
        return self.obj.modify(ModifyQpIn(opcode=op, qpn=self.qpn, opt_param_mask=opt,
                                          sw_qpc=qpc), len(ModifyQpOut()))

    def state(self):
        out = self.obj.query(QueryQpIn(qpn=self.qpn), len(QueryQpOut()))
        return QueryQpOut(out).sw_qpc.state

    def connect(self, peer):
        q = SwQpc(rre=1, rwe=1, rae=1, atomic_mode=3)
        q.primary_address_path.vhca_port_num = 1
        self.modify(DevxOps.MLX5_CMD_OP_RST2INIT_QP, q)
        q = SwQpc(mtu=3, log_msg_max=30, remote_qpn=peer.qpn, min_rnr_nak=12,
                  next_rcv_psn=peer.psn, log_rra_max=2)
        p = q.primary_address_path
        p.vhca_port_num = 1
        p.rgid_rip = gid_words(peer.dev.gid)
        p.src_addr_index = 0
        p.hop_limit = 64
        p.udp_sport = 0xdcba
        self.modify(DevxOps.MLX5_CMD_OP_INIT2RTR_QP, q)
        q = SwQpc(retry_count=7, rnr_retry=7, next_send_psn=self.psn, log_sra_max=2)
        q.primary_address_path.vhca_port_num = 1
        q.primary_address_path.ack_timeout = 14
        self.modify(DevxOps.MLX5_CMD_OP_RTR2RTS_QP, q)

    def post_recv(self, addr, length, lkey):
        slot = self.wq.umem_addr + (self.rq_head % self.rq_n) * 16
        poke(slot, struct.pack('>IIQ', length, lkey, addr))
        self.rq_head += 1
        be32_at(self.dbr.umem_addr, 0, self.rq_head & 0xffff)

    def post(self, op, local=None, remote=None, imm=0, atomic=None, signaled=True, ring=True,
             av=b'', seg=b''):
        """One WQE: ctrl, [address vector], [segment], [raddr], [atomic], [data]; `local` =
        (addr, len, lkey), `remote` = (addr, rkey), `atomic` = (swap_add, compare), `av` 48
        bytes, `seg` a segment of its own (16 bytes: a WAIT's)."""
        segs = av + seg
        if remote is not None:
            segs += struct.pack('>QII', remote[0], remote[1], 0)
        if atomic is not None:
            segs += struct.pack('>QQ', atomic[0], atomic[1])
        if local is not None:
            segs += struct.pack('>IIQ', local[1], local[2], local[0])
        ds = 1 + len(segs) // 16
        ctrl = struct.pack('>IIBBBBI', (self.pi & 0xffff) << 8 | op, self.qpn << 8 | ds,
                           0, 0, 0, 0x08 if signaled else 0, imm)
        wqe = ctrl + segs
        blocks = (len(wqe) + 63) // 64
        base = self.wq.umem_addr + self.rq_bytes
        for i in range(blocks):
            chunk = wqe[i * 64:(i + 1) * 64]
            poke(base + ((self.pi + i) % self.sq_n) * 64, chunk)
        self.pi += blocks
        if not self.no_dbr:
            be32_at(self.dbr.umem_addr, 4, self.pi & 0xffff)
        if ring:
            store64(self.db, ctrl[:8])
        return self.pi - blocks

    def close(self):
        self.obj.close()
        self.wq.close()
        self.dbr.close()


def pair(log_cq=6, cc=0, cqe_sz=0):
    a, b = Dev('mlx5_0'), Dev('mlx5_1')
    ca, cb = Cq(a, log_cq, cc=cc, cqe_sz=cqe_sz), Cq(b, log_cq, cqe_sz=cqe_sz)
    qa, qb = Qp(a, ca, ca), Qp(b, cb, cb)
    qa.connect(qb)
    qb.connect(qa)
    return a, b, ca, cb, qa, qb


def case_queries():
    d = Dev('mlx5_0')
    out = QueryCmdHcaCapOut(d.cmd(QueryHcaCapIn(op_mod=0x1), len(QueryCmdHcaCapOut())))
    check(out.status == 0, f'QUERY_HCA_CAP status {out.status}')
    cap = out.capability
    for field, want in [('port_type', 1), ('rc', 1), ('uc', 0), ('xrc', 1), ('dct', 1),
                        ('cqe_version', 1), ('log_max_qp_sz', 15), ('atomic', 1), ('cd', 1),
                        ('roce', 1), ('cq_oi', 1), ('log_bf_reg_size', 9), ('num_ports', 1),
                        ('log_max_msg', 30), ('max_wqe_sz_sq', 1024), ('hca_cap_2', 1),
                        ('num_lag_ports', 0), ('qos', 0), ('crypto', 0),
                        ('general_obj_types', 0)]:
        check(getattr(cap, field) == want,
              f'general cap {field} = {getattr(cap, field)}, want {want}')
    raw = d.cmd(QueryHcaCapIn(op_mod=0x7), 16 + 4096)[16:]
    check(bits(raw, 144, 16) == 0xf, f'atomic_operations {bits(raw, 144, 16):#x}')
    check(bits(raw, 176, 16) == 0xc, f'atomic_size_qp {bits(raw, 176, 16):#x}')
    check(bits(raw, 64, 2) == 1 and bits(raw, 70, 1) == 1, 'atomic endianness mode')
    raw = d.cmd(QueryHcaCapIn(op_mod=0x9), 16 + 4096)[16:]
    check(bits(raw, 240, 16) == 1, 'roce_address_table_size')
    check(bits(raw, 208, 16) <= bits(raw, 192, 16), 'RoCE UDP source-port range')
    raw = d.cmd(QueryHcaCapIn(op_mod=0x41), 16 + 4096)[16:]
    check(bits(raw, 737, 1) == 1, 'cap2 send_dbr_mode_no_dbr_ext')
    rest = bytearray(raw)
    put_bits(rest, 737, 1, 0)
    check(not any(rest), 'cap2 has bits set the soft NIC does not implement')
    # QUERY_ROCE_ADDRESS 0x760: index 0 is the port's GID (RoCE v2), index 1 does not exist
    q = struct.pack('>HHHHHHI', 0x760, 0, 0, 0, 0, 0, 0)
    out = d.cmd(q, 16 + 32)
    check(out[16:32] == d.gid, f'RoCE address {out[16:32].hex()} != GID {d.gid.hex()}')
    check(out[16 + 27] == 2, f'roce_version {out[16 + 27]}')
    q1 = struct.pack('>HHHHHHI', 0x760, 0, 0, 0, 1, 0, 0)
    expect_errno(EREMOTEIO, 'QUERY_ROCE_ADDRESS index 1', lambda: d.cmd(q1, 48))
    vp = QueryHcaVportContextOut(d.cmd(QueryHcaVportContextIn(port_num=1),
                                       len(QueryHcaVportContextOut())))
    check(vp.hca_vport_context.port_state == 4, 'vport port_state')
    # a command OTHER does not pass (ACCESS_REG), one it passes but the device lacks
    # (QUERY_ISSI: the out-mailbox says BAD_OP), an unknown capability type, a short mailbox
    reg = struct.pack('>HHHHII', 0x805, 0, 0, 0, 0, 0)
    expect_errno(errno.EINVAL, 'ACCESS_REG through OTHER', lambda: d.cmd(reg, 16))
    issi = struct.pack('>HHHHII', 0x10a, 0, 0, 0, 0, 0)
    expect_errno(EREMOTEIO, 'QUERY_ISSI', lambda: d.cmd(issi, 16 + 256))
    expect_errno(EREMOTEIO, 'QUERY_HCA_CAP type 0x3f',
                 lambda: d.cmd(QueryHcaCapIn(op_mod=0x7f), 16 + 4096))
    expect_errno(errno.EINVAL, '8-byte mailbox', lambda: d.cmd(b'\x01\x00' + bytes(6), 16))
    check(d.eqn == d.ctx.devx_query_eqn(0), 'QUERY_EQN not stable')
    expect_errno(errno.EINVAL, 'QUERY_EQN vector 1', lambda: d.ctx.devx_query_eqn(1))


def case_umems():
    d = Dev('mlx5_0')
    expect_errno(errno.EINVAL, 'umem REMOTE_WRITE without LOCAL_WRITE',
                 lambda: d.umem(4096, access=e.IBV_ACCESS_REMOTE_WRITE))
    expect_errno(errno.EINVAL, 'umem with REMOTE_ATOMIC',
                 lambda: d.umem(4096, access=e.IBV_ACCESS_LOCAL_WRITE |
                                e.IBV_ACCESS_REMOTE_ATOMIC))
    # a CQ on a ring umem one page too small, and a doorbell record past its umem
    small = d.umem(4096)
    dbr = d.umem(8, align=8)
    big = CreateCqIn(cq_umem_valid=1, cq_umem_id=small.umem_id,
                     sw_cqc=SwCqc(c_eqn=d.eqn, uar_page=d.uar.page_id, log_cq_size=7,
                                  dbr_umem_valid=1, dbr_umem_id=dbr.umem_id))
    expect_errno(EREMOTEIO, 'CQ ring larger than its umem',
                 lambda: Mlx5DevxObj(d.ctx, big, len(CreateCqOut())))
    off = CreateCqIn(cq_umem_valid=1, cq_umem_id=small.umem_id,
                     sw_cqc=SwCqc(c_eqn=d.eqn, uar_page=d.uar.page_id, log_cq_size=6,
                                  dbr_umem_valid=1, dbr_umem_id=dbr.umem_id,
                                  db_record_addr_31_3=1))
    expect_errno(EREMOTEIO, 'CQ doorbell record past its umem',
                 lambda: Mlx5DevxObj(d.ctx, off, len(CreateCqOut())))
    for name, cqc in [('padded 128-byte CQEs', dict(cqe_sz=2)),
                      ('a reserved CQE size', dict(cqe_sz=3)), ('a bad EQ', dict(c_eqn=d.eqn + 1)),
                      ('a bad UAR page', dict(uar_page=0xfff0))]:
        args = dict(c_eqn=d.eqn, uar_page=d.uar.page_id, log_cq_size=6, dbr_umem_valid=1,
                    dbr_umem_id=dbr.umem_id)
        args.update(cqc)
        cmd_in = CreateCqIn(cq_umem_valid=1, cq_umem_id=small.umem_id, sw_cqc=SwCqc(**args))
        expect_errno(EREMOTEIO, f'CQ with {name}',
                     lambda: Mlx5DevxObj(d.ctx, cmd_in, len(CreateCqOut())))
    # a umem under a live CQ cannot go (on memory of the script's own: pyverbs frees the
    # buffers it allocated even when the dereg fails); a CQ under a live QP cannot go
    page = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    mine = Mlx5UMEM(d.ctx, size=4096, addr=addr, access=e.IBV_ACCESS_LOCAL_WRITE)
    on_mine = Mlx5DevxObj(d.ctx, CreateCqIn(
        cq_umem_valid=1, cq_umem_id=mine.umem_id,
        sw_cqc=SwCqc(c_eqn=d.eqn, uar_page=d.uar.page_id, log_cq_size=6, dbr_umem_valid=1,
                     dbr_umem_id=dbr.umem_id)), len(CreateCqOut()))
    expect_errno(errno.EBUSY, 'dereg of a umem a CQ uses', mine.close)
    on_mine.close()
    mine.close()
    cq = Cq(d)
    qp = Qp(d, cq, cq)
    expect_errno(errno.EBUSY, 'destroy of a CQ a QP uses', cq.obj.close)
    for name, kw in [('UD', dict(st=2)), ('a PD not ours', dict(pd=0xabcd)),
                     ('a CQ not ours', dict(cqn_snd=0xabcd)),
                     ('scatter to CQE', dict(cs_res=1))]:
        args = dict(st=0, pd=d.pdn, log_sq_size=4, log_rq_size=4, uar_page=d.uar.page_id,
                    cqn_snd=cq.cqn, cqn_rcv=cq.cqn, dbr_umem_id=qp.dbr.umem_id, dbr_umem_valid=1)
        args.update(kw)
        cmd_in = CreateQpIn(sw_qpc=SwQpc(**args), wq_umem_id=qp.wq.umem_id, wq_umem_valid=1)
        expect_errno(EREMOTEIO, f'QP with {name}',
                     lambda: Mlx5DevxObj(d.ctx, cmd_in, len(CreateQpOut())))
    qp.close()
    cq.close()
    small.close()
    dbr.close()


def dc_av(dctn, key, gid):
    """A DC initiator's 48-byte address vector: key, DCT number (extended-AV bit), GID."""
    return struct.pack('>QI', key, dctn | 1 << 31) + bytes(20) + gid


def case_dc():
    """A DC target (CREATE_DCT on a verbs SRQ, active at once; QUERY_DCT) and a DEVX DC
    initiator (CREATE_QP st DCI, RST2INIT, INIT2RTR with no peer, RTR2RTS) on another device:
    a WRITE and a SEND into the SRQ, then the wrong key (no answer: TRANSPORT_RETRY_EXC), then
    DRAIN_DCT."""
    a, b = Dev('mlx5_0'), Dev('mlx5_1')
    out = QueryCmdHcaCapOut(b.cmd(QueryHcaCapIn(op_mod=0x1), len(QueryCmdHcaCapOut())))
    check(out.capability.dct == 1, 'dct capability')
    raw = b.cmd(QueryHcaCapIn(op_mod=0x7), 16 + 4096)[16:]
    check(bits(raw, 208, 16) == 0xc, f'atomic_size_dc {bits(raw, 208, 16):#x}')
    ca, cb = Cq(a), Cq(b)
    srq = b.own(SRQ(b.pd, SrqInitAttr(SrqAttr(max_wr=16, max_sge=1))))
    srqn = srq.get_srq_num()
    key = 0x1ee7a330
    mbox = bytearray(16 + 112)
    put_bits(mbox, 0, 16, 0x710)
    for bit, width, v in [(40, 24, 7), (72, 24, cb.cqn), (108, 1, 1), (109, 1, 1), (110, 1, 1),
                          (147, 5, 12), (168, 24, srqn), (200, 24, b.pdn), (256, 64, key),
                          (325, 3, 5), (328, 8, 1), (376, 8, 64)]:
        put_bits(mbox, 128 + bit, width, v)
    dct = b.own(Mlx5DevxObj(b.ctx, bytes(mbox), 16))
    dctn = bits(bytes(dct.out_view), 72, 24)
    q = bytearray(16)
    put_bits(q, 0, 16, 0x713)
    put_bits(q, 72, 24, dctn)
    got = bytes(dct.query(bytes(q), 16 + 112))
    check(bits(got, 128 + 4, 4) == 0 and bits(got, 128 + 256, 64) == key, 'QUERY_DCT')
    qa = Qp(a, ca, ca, log_rq=0, rq_type=3, st=5)
    qpc = SwQpc()
    qpc.primary_address_path.vhca_port_num = 1
    qa.modify(DevxOps.MLX5_CMD_OP_RST2INIT_QP, qpc)
    qa.modify(DevxOps.MLX5_CMD_OP_INIT2RTR_QP, SwQpc(mtu=5, log_msg_max=30))
    q = SwQpc(retry_count=0, rnr_retry=0, next_send_psn=0, log_sra_max=2)
    q.primary_address_path.vhca_port_num = 1
    q.primary_address_path.ack_timeout = 10
    qa.modify(DevxOps.MLX5_CMD_OP_RTR2RTS_QP, q)
    check(qa.state() == 3, 'DCI not in RTS')
    la, lb = a.mr.buf, b.mr.buf
    data = bytes(random.getrandbits(8) for _ in range(4096))
    a.mr.write(data, len(data))
    av = dc_av(dctn, key, b.gid)
    idx = qa.post(OP_WRITE, local=(la, 4096, a.mr.lkey), remote=(lb + 8192, b.mr.rkey), av=av)
    c = ca.poll()
    check(opcode(c) == CQE_REQ and wqe_counter(c) == idx, f'DC WRITE CQE {c.hex()}')
    check(b.mr.read(4096, 8192) == data, 'DC WRITE bytes differ')
    srq.post_recv(RecvWR(num_sge=1, sg=[SGE(lb + 32768, 1024, b.mr.lkey)]))
    qa.post(OP_SEND, local=(la, 300, a.mr.lkey), av=av)
    check(opcode(ca.poll()) == CQE_REQ, 'DC SEND CQE')
    c = cb.poll()
    check(opcode(c) == CQE_RESP_SEND and struct.unpack('>I', c[44:48])[0] == 300,
          f'DCT receive CQE {c.hex()}')
    check(b.mr.read(300, 32768) == data[:300], 'DC SEND bytes differ')
    # the wrong key: the target stays silent, the initiator's timer ends it
    qa.post(OP_WRITE, local=(la, 64, a.mr.lkey), remote=(lb, b.mr.rkey),
            av=dc_av(dctn, key ^ 1, b.gid))
    c = ca.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x15, f'wrong key CQE {c.hex()}')
    q = bytearray(16)
    put_bits(q, 0, 16, 0x712)
    put_bits(q, 72, 24, dctn)
    dct.modify(bytes(q), 16)
    q = bytearray(16)
    put_bits(q, 0, 16, 0x713)
    put_bits(q, 72, 24, dctn)
    check(bits(bytes(dct.query(bytes(q), 16 + 112)), 128 + 4, 4) == 2, 'DCT not drained')
    qa.close()


def case_no_dbr():
    """A QP created with send_dbr_mode NO_DBR_EXT (what cap2's send_dbr_mode_no_dbr_ext
    offers, a ConnectX-8's mode): its WRITEs are rung at the UAR page's DBR-less register with
    the send doorbell record never written, and run."""
    a, b = Dev('mlx5_0'), Dev('mlx5_1')
    ca, cb = Cq(a), Cq(b)
    qa, qb = Qp(a, ca, ca, no_dbr=True), Qp(b, cb, cb)
    qa.connect(qb)
    qb.connect(qa)
    la, lb = a.mr.buf, b.mr.buf
    for i in range(70):
        data = bytes(random.getrandbits(8) for _ in range(256))
        a.mr.write(data, len(data))
        idx = qa.post(OP_WRITE, local=(la, 256, a.mr.lkey), remote=(lb + 256 * (i % 8), b.mr.rkey))
        c = ca.poll()
        check(opcode(c) == CQE_REQ and wqe_counter(c) == idx, f'no-DBR WRITE CQE {c.hex()}')
        check(b.mr.read(256, 256 * (i % 8)) == data, 'no-DBR WRITE bytes differ')
    check(peek(qa.dbr.umem_addr, 8) == bytes(8), 'the send doorbell record was written')
    qa.close()
    qb.close()


def case_traffic():
    a, b, ca, cb, qa, qb = pair()
    check(qa.state() == 3 and qb.state() == 3, 'QPs not in RTS')
    la, lb = a.mr.buf, b.mr.buf
    # WRITE 4 KiB a -> b
    data = bytes(random.getrandbits(8) for _ in range(4096))
    a.mr.write(data, len(data))
    idx = qa.post(OP_WRITE, local=(la, 4096, a.mr.lkey), remote=(lb + 8192, b.mr.rkey))
    c = ca.poll()
    check(opcode(c) == CQE_REQ and wqe_counter(c) == idx, f'WRITE CQE {c.hex()}')
    check(b.mr.read(4096, 8192) == data, 'WRITE bytes differ')
    # READ 4 KiB back from b into a at 16 KiB
    idx = qa.post(OP_READ, local=(la + 16384, 4096, a.mr.lkey), remote=(lb + 8192, b.mr.rkey))
    c = ca.poll()
    check(opcode(c) == CQE_REQ and wqe_counter(c) == idx, f'READ CQE {c.hex()}')
    check(a.mr.read(4096, 16384) == data, 'READ bytes differ')
    # SEND_IMM 512 B into a posted receive
    qb.post_recv(lb + 32768, 1024, b.mr.lkey)
    msg = bytes(random.getrandbits(8) for _ in range(512))
    a.mr.write(msg, len(msg))
    qa.post(OP_SEND_IMM, local=(la, 512, a.mr.lkey), imm=0x11223344)
    ca.poll()
    c = cb.poll()
    check(opcode(c) == CQE_RESP_SEND_IMM, f'receive CQE {c.hex()}')
    check(struct.unpack('>I', c[44:48])[0] == 512, 'receive byte count')
    check(c[36:40] == struct.pack('>I', 0x11223344), 'immediate data')
    check(b.mr.read(512, 32768) == msg, 'SEND bytes differ')
    # atomics on b's word at 40 KiB (host byte order in memory, as the device's endianness
    # mode 1 says): fetch-and-add, then compare-and-swap taken and not taken
    b.mr.write(struct.pack('<Q', 1000), 8, 40960)
    qa.post(OP_FA, local=(la + 24576, 8, a.mr.lkey), remote=(lb + 40960, b.mr.rkey),
            atomic=(5, 0))
    ca.poll()
    check(struct.unpack('<Q', a.mr.read(8, 24576))[0] == 1000, 'FETCH_ADD old value')
    check(struct.unpack('<Q', b.mr.read(8, 40960))[0] == 1005, 'FETCH_ADD result')
    qa.post(OP_CS, local=(la + 24576, 8, a.mr.lkey), remote=(lb + 40960, b.mr.rkey),
            atomic=(7, 1005))
    ca.poll()
    check(struct.unpack('<Q', b.mr.read(8, 40960))[0] == 7, 'CMP_SWP taken')
    qa.post(OP_CS, local=(la + 24576, 8, a.mr.lkey), remote=(lb + 40960, b.mr.rkey),
            atomic=(9, 1005))
    ca.poll()
    check(struct.unpack('<Q', b.mr.read(8, 40960))[0] == 7, 'CMP_SWP not taken')
    check(struct.unpack('<Q', a.mr.read(8, 24576))[0] == 7, 'CMP_SWP old value')
    # 200 WRITEs through a 64-block SQ and CQ, one doorbell per 8 WQEs (laps of both rings)
    for i in range(200):
        qa.post(OP_WRITE, local=(la + i * 8, 8, a.mr.lkey), remote=(lb + 49152 + i * 8, b.mr.rkey),
                ring=(i % 8 == 7))
        if i % 8 == 7:
            for _ in range(8):
                check(opcode(ca.poll()) == CQE_REQ, 'WRITE burst')
    check(b.mr.read(1600, 49152) == a.mr.read(1600, 0), 'burst bytes differ')
    # a bad rkey: REQ_ERR with syndrome remote access error; the QP goes to ERR
    qa.post(OP_WRITE, local=(la, 64, a.mr.lkey), remote=(lb, b.mr.rkey ^ 0x5500))
    c = ca.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x13, f'bad rkey CQE {c.hex()}')
    check(qa.state() == 6, 'QP not in ERR after an error CQE')
    traffic_cqe128()


def traffic_cqe128():
    """CQs of 128-byte entries (cqe_sz 1): each CQE in its entry's second half, the first half
    untouched, owner bits per lap of a 4-entry ring; a receive and an error CQE too."""
    a, b, ca, cb, qa, qb = pair(log_cq=2, cqe_sz=1)
    la, lb = a.mr.buf, b.mr.buf
    for cq in (ca, cb):
        for i in range(cq.n):
            poke(cq.ring.umem_addr + i * 128, b'\xab' * 64)
    for i in range(10):
        idx = qa.post(OP_WRITE, local=(la + i * 8, 8, a.mr.lkey), remote=(lb + i * 8, b.mr.rkey))
        c = ca.poll()
        check(opcode(c) == CQE_REQ and wqe_counter(c) == idx, f'128-byte CQE {i}: {c.hex()}')
        check(ca.first_half(i) == b'\xab' * 64, f'128-byte entry {i}: first half written')
    check(b.mr.read(80, 0) == a.mr.read(80, 0), 'WRITE bytes differ (128-byte CQEs)')
    qb.post_recv(lb + 32768, 1024, b.mr.lkey)
    qa.post(OP_SEND_IMM, local=(la, 100, a.mr.lkey), imm=0x55667788)
    ca.poll()
    c = cb.poll()
    check(opcode(c) == CQE_RESP_SEND_IMM and struct.unpack('>I', c[44:48])[0] == 100,
          f'receive CQE (128-byte entry) {c.hex()}')
    check(c[63] & 0x0c == 0, 'inline-scatter bits set though no data was scattered')
    check(cb.first_half(0) == b'\xab' * 64, 'receive entry: first half written')
    qa.post(OP_WRITE, local=(la, 64, a.mr.lkey), remote=(lb, b.mr.rkey ^ 0x5500))
    c = ca.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x13, f'bad rkey CQE (128-byte entry) {c.hex()}')


def case_collapsed():
    a, b, ca, cb, qa, qb = pair(log_cq=4, cc=1)
    la, lb = a.mr.buf, b.mr.buf
    for i in range(40):
        idx = qa.post(OP_WRITE, local=(la, 64, a.mr.lkey), remote=(lb + 64 * i, b.mr.rkey))
        t = time.monotonic()
        while True:
            c = ca.entry(0)
            if opcode(c) == CQE_REQ and wqe_counter(c) == idx:
                break
            check(time.monotonic() - t < 10, f'collapsed CQE for WQE {idx}: {c.hex()}')
    blank = bytes(63) + b'\xf0'
    for i in range(1, ca.n):
        check(ca.entry(i) == blank, f'collapsed CQ wrote entry {i}: {ca.entry(i).hex()}')


def case_transitions():
    d = Dev('mlx5_0')
    cq = Cq(d)
    qp = Qp(d, cq, cq)
    check(qp.state() == 0, 'new QP not in RESET')
    q = SwQpc(mtu=3, remote_qpn=1, next_rcv_psn=0)
    q.primary_address_path.rgid_rip = gid_words(d.gid)
    expect_errno(EREMOTEIO, 'INIT2RTR from RESET',
                 lambda: qp.modify(DevxOps.MLX5_CMD_OP_INIT2RTR_QP, q))
    expect_errno(EREMOTEIO, 'RTR2RTS from RESET',
                 lambda: qp.modify(DevxOps.MLX5_CMD_OP_RTR2RTS_QP, SwQpc()))
    init = SwQpc(rwe=1)
    init.primary_address_path.vhca_port_num = 1
    qp.modify(DevxOps.MLX5_CMD_OP_RST2INIT_QP, init)
    check(qp.state() == 1, 'RST2INIT')
    qp.modify(0x50e, SwQpc(rwe=1, rre=1), opt=0xe)  # INIT2INIT with the rights
    check(qp.state() == 1, 'INIT2INIT')
    expect_errno(EREMOTEIO, 'RTS2RTS from INIT',
                 lambda: qp.modify(DevxOps.MLX5_CMD_OP_RTS2RTS_QP, SwQpc()))
    expect_errno(EREMOTEIO, 'RST2INIT from INIT',
                 lambda: qp.modify(DevxOps.MLX5_CMD_OP_RST2INIT_QP, init))
    bad_mtu = SwQpc(mtu=7, remote_qpn=1)
    bad_mtu.primary_address_path.rgid_rip = gid_words(d.gid)
    expect_errno(EREMOTEIO, 'INIT2RTR with MTU code 7',
                 lambda: qp.modify(DevxOps.MLX5_CMD_OP_INIT2RTR_QP, bad_mtu))
    # a posted WQE is flushed once the QP is in ERR; 2RST brings it back to RESET
    qp.modify(0x507, SwQpc())
    check(qp.state() == 6, '2ERR')
    idx = qp.post(OP_WRITE, local=(d.mr.buf, 8, d.mr.lkey), remote=(0, 0))
    c = cq.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x05 and wqe_counter(c) == idx,
          f'flush CQE {c.hex()}')
    qp.modify(0x50a, SwQpc())
    check(qp.state() == 0, '2RST')
    # the command's QP number must be the handle's
    expect_errno(errno.EINVAL, 'modify naming another QP',
                 lambda: qp.obj.modify(ModifyQpIn(opcode=DevxOps.MLX5_CMD_OP_RST2INIT_QP,
                                                  qpn=qp.qpn ^ 1, sw_qpc=init),
                                       len(ModifyQpOut())))
    qp.close()
    cq.close()


def case_cross_channel():
    """A QP created with cd_master (a cross-channel master, as DOCA GPUNetIO's companion QP)
    and connected to itself: for each WRITE of another QP, a WAIT for that WRITE's CQE number on
    its send CQ, then a FETCH_ADD on a counter of its own device; the counter moves once per
    completed WRITE, and not for a WRITE into a bad rkey (the WAIT for its error CQE ends with
    WR_FLUSH, the FETCH_ADD is flushed). A WAIT on a QP without cd_master is LOCAL_QP_OP; the
    slave bits are refused."""
    a, b, ca, cb, qa, qb = pair()
    cc = Cq(a)
    qc = Qp(a, cc, cc, cd_master=1)
    qc.connect(qc)
    la, lb = a.mr.buf, b.mr.buf
    ctr, res = 60000, 61000
    a.mr.write(bytes(8), 8, ctr)

    def count(cqe):
        qc.post(OP_WAIT, seg=struct.pack('>QII', 0, cqe, ca.cqn), signaled=False, ring=False)
        return qc.post(OP_FA, local=(la + res, 8, a.mr.lkey), remote=(la + ctr, a.mr.rkey),
                       atomic=(1, 0))

    for i in range(3):
        idx = qa.post(OP_WRITE, local=(la, 64, a.mr.lkey), remote=(lb + 64 * i, b.mr.rkey))
        f = count(i)
        c = cc.poll()
        check(opcode(c) == CQE_REQ and wqe_counter(c) == f, f'companion FETCH_ADD CQE {c.hex()}')
        check(struct.unpack('<Q', a.mr.read(8, ctr))[0] == i + 1, f'counter after WRITE {i}')
        c = ca.poll()
        check(opcode(c) == CQE_REQ and wqe_counter(c) == idx, f'WRITE CQE {c.hex()}')
    qa.post(OP_WRITE, local=(la, 64, a.mr.lkey), remote=(lb, b.mr.rkey ^ 0x5500))
    count(3)
    c = ca.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x13, f'bad rkey CQE {c.hex()}')
    c = cc.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x05 and c[56] == OP_WAIT,
          f'WAIT for an error CQE: {c.hex()}')
    c = cc.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x05, f'FETCH_ADD behind it: {c.hex()}')
    check(struct.unpack('<Q', a.mr.read(8, ctr))[0] == 3, 'the failed WRITE moved the counter')
    check(qc.state() == 6, 'the companion not in ERR')
    # a WAIT on a QP that is not a cross-channel master (connected to itself, in RTS)
    cd = Cq(a)
    qd = Qp(a, cd, cd)
    qd.connect(qd)
    qd.post(OP_WAIT, seg=struct.pack('>QII', 0, 0, cd.cqn))
    c = cd.poll()
    check(opcode(c) == CQE_REQ_ERR and c[55] == 0x02, f'WAIT without cd_master: {c.hex()}')
    for name in ('cd_slave_send', 'cd_slave_receive'):
        args = dict(st=0, pd=a.pdn, log_sq_size=4, log_rq_size=4, uar_page=a.uar.page_id,
                    cqn_snd=cc.cqn, cqn_rcv=cc.cqn, dbr_umem_id=qc.dbr.umem_id,
                    dbr_umem_valid=1)
        args[name] = 1
        cmd_in = CreateQpIn(sw_qpc=SwQpc(**args), wq_umem_id=qc.wq.umem_id, wq_umem_valid=1)
        expect_errno(EREMOTEIO, f'QP with {name}',
                     lambda: Mlx5DevxObj(a.ctx, cmd_in, len(CreateQpOut())))
    for q in (qd, qc, qa, qb):
        q.close()


CASES = {
    'queries': case_queries,
    'umems': case_umems,
    'traffic': case_traffic,
    'collapsed': case_collapsed,
    'transitions': case_transitions,
    'dc': case_dc,
    'no_dbr': case_no_dbr,
    'cross_channel': case_cross_channel,
}


def main():
    signal.alarm(120)
    for name in sys.argv[2:]:
        CASES[name]()
        while DEVS:
            DEVS.pop().close()
        print(f'PASS {name}', flush=True)


if __name__ == '__main__':
    main()
