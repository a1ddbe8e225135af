#!/usr/bin/python3
"""Checks gpuverbs' PRM field tables (crates/prm/src/cmd) against rdma-core's own description
of the structures (tests/mlx5_prm_structs.py, scapy).

Usage: prm_layout.py MLX5_PRM_STRUCTS_PY < tables.json, where tables.json is a list of
{"struct": NAME, "fields": [[field, bit, width], ...]} (field names in any case). For each
field the script sets it to all ones in an otherwise zero structure and finds the bits that
changed. Prints `OK <n> fields` or one line per mismatch and exits 1.
"""

import importlib.util
import json
import sys

spec = importlib.util.spec_from_file_location('mlx5_prm_structs', sys.argv[1])
prm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prm)


def locate(cls, name):
    """(bit offset, width) of field `name` of `cls`, as scapy lays it out."""
    pkt = cls()
    field = pkt.get_field(name)
    kind = type(field).__name__
    if kind.startswith('Bit'):
        width = field.size
    elif kind == 'FieldListField':
        width = 32 * len(getattr(pkt, name))
    elif kind == 'MACField':
        width = 48
    elif hasattr(field, 'sz'):
        width = field.sz * 8
    else:
        raise ValueError(f'{name}: field kind {kind}')
    zero = int.from_bytes(bytes(pkt), 'big')
    if kind == 'MACField':
        setattr(pkt, name, 'ff:ff:ff:ff:ff:ff')
    elif kind == 'FieldListField':
        setattr(pkt, name, [0xffffffff] * (width // 32))
    else:
        setattr(pkt, name, (1 << width) - 1)
    raw = bytes(pkt)
    diff = zero ^ int.from_bytes(raw, 'big')
    return len(raw) * 8 - diff.bit_length(), width


# gpuverbs fields that rdma-core describes in parts (an address whose low bits are reserved) or
# under a longer name
ALIASES = {
    'dbr_addr': ['db_record_addr_63_32', 'db_record_addr_31_3'],
    'cq_umem_offset': ['e_mtt_pointer_or_cq_umem_offset'],
    'wq_umem_offset': ['e_mtt_pointer_or_wq_umem_offset'],
}


def main():
    bad, n = [], 0
    for table in json.load(sys.stdin):
        cls = getattr(prm, table['struct'])
        names = {f.name.lower(): f.name for f in cls.fields_desc}
        for field, bit, width in table['fields']:
            real = names.get(field.lower())
            parts = [names.get(p) for p in ALIASES.get(field.lower(), [])]
            if real is None and parts and None not in parts:
                spans = [locate(cls, p) for p in parts]
                start, end = spans[0][0], spans[-1][0] + spans[-1][1]
                n += 1
                # the parts cover the field; only reserved low bits (at most 3) may follow them
                if start != bit or not 0 <= bit + width - end <= 3:
                    bad.append(f"{table['struct']}.{field}: gpuverbs bit {bit} width {width}, "
                               f"rdma-core parts {parts} span bits {start}..{end}")
                continue
            if real is None:
                bad.append(f"{table['struct']}.{field}: no such field in rdma-core")
                continue
            got = locate(cls, real)
            n += 1
            if got != (bit, width):
                bad.append(f"{table['struct']}.{field}: gpuverbs bit {bit} width {width}, "
                           f"rdma-core bit {got[0]} width {got[1]}")
    for b in bad:
        print(b)
    if bad:
        sys.exit(1)
    print(f'OK {n} fields')


main()
