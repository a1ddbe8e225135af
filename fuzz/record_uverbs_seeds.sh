#!/usr/bin/env bash
# Records the uverbs fuzz target's seeds: the command streams of Debian's ibv_rc_pingpong,
# rping (rdma_cm) and perftest (server and client) and of rdma-core's pyverbs tests under `gpuverbs emu`
# (GPUVERBS_EMU_RECORD), split at record boundaries into files of at most 16 KiB, into
# fuzz/corpus/uverbs/; and the distinct WQEs libmlx5 wrote into those programs' send queues
# (left by the emulation as each QP is destroyed) into fuzz/corpus/wqe/ as libmlx5_*. Needs a
# debug build of gpuverbs-command and the preload library, and the
# Debian packages the emulation tests use (ibverbs-utils, rdmacm-utils, perftest, rdma-core, python3-pyverbs).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
g="$root/target/debug/gpuverbs"
export GPUVERBS_PRELOAD="$root/target/debug/libgpuverbs_uverbs_preload.so"
rec="$(mktemp -d)"
out="$root/fuzz/corpus/uverbs"
trap 'rm -rf "$rec"' EXIT

# a server and a client, each under its own emulated device; side1 is the server
pair() {
  local name=$1; shift
  mkdir -p "$rec/$name.1" "$rec/$name.2"
  GPUVERBS_EMU_RECORD="$rec/$name.1" "$g" emu --ip 127.0.94.1 -- "$@" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  GPUVERBS_EMU_RECORD="$rec/$name.2" timeout 60 "$g" emu --ip 127.0.94.2 -- "$@" 127.0.94.1 >/dev/null 2>&1
  wait "$server"
  cat "$rec/$name.1"/*.stream > "$rec/${name}_side1.s"
  cat "$rec/$name.2"/*.stream > "$rec/${name}_side2.s"
}
pair ibv_rc_pingpong ibv_rc_pingpong -g 0 -n 5 -p 18515
# rdma_cm (the connection manager's ucma commands, records of kind 2, with the verbs ones)
mkdir -p "$rec/rping.1" "$rec/rping.2"
GPUVERBS_EMU_RECORD="$rec/rping.1" "$g" emu --ip 127.0.94.1 -- rping -s -a 127.0.94.1 -C 3 -V >/dev/null 2>&1 &
server=$!
sleep 1
GPUVERBS_EMU_RECORD="$rec/rping.2" timeout 60 "$g" emu --ip 127.0.94.2 -- rping -c -a 127.0.94.1 -C 3 -V >/dev/null 2>&1
wait "$server"
cat "$rec/rping.1"/*.stream > "$rec/rping_side1.s"
cat "$rec/rping.2"/*.stream > "$rec/rping_side2.s"
# multicast: JOIN_MCAST, ATTACH_MCAST / DETACH_MCAST, LEAVE_MCAST (mckey's receiver and sender)
mkdir -p "$rec/mckey.1" "$rec/mckey.2"
GPUVERBS_EMU_RECORD="$rec/mckey.1" timeout 60 "$g" emu --ip 127.0.94.1 -- mckey -m 239.94.0.1 -b 127.0.94.1 -C 3 >/dev/null 2>&1 &
server=$!
sleep 1
GPUVERBS_EMU_RECORD="$rec/mckey.2" timeout 60 "$g" emu --ip 127.0.94.2 -- mckey -m 239.94.0.1 -b 127.0.94.2 -s -C 3 >/dev/null 2>&1
wait "$server"
cat "$rec/mckey.1"/*.stream > "$rec/mckey_side1.s"
cat "$rec/mckey.2"/*.stream > "$rec/mckey_side2.s"
for t in ib_write_bw ib_read_bw ib_atomic_bw ib_send_bw; do
  pair "$t" "$t" -x 0 -n 10 -p 18600
done

suite="$rec/tests"
cp -r /usr/share/doc/rdma-core/tests "$suite"
(cd "$suite" && gunzip -f ./*.gz)
for m in test_mlx5_devx test_mlx5_mkey test_cq test_qp test_mr test_mlx5_uar test_mlx5_timestamp; do
  mkdir -p "$rec/$m"
  (cd "$suite" && GPUVERBS_EMU_RECORD="$rec/$m" timeout 300 "$g" emu --ip 127.0.96.1 -- \
    /usr/bin/python3 run_tests.py --dev mlx5_0 --port 1 --gid 0 -k "$m" >/dev/null 2>&1) || true
  cat "$rec/$m"/*.stream > "$rec/$m.s"
done

rm -rf "$out"
mkdir -p "$out"
wqes="$root/fuzz/corpus/wqe"
rm -f "$wqes"/libmlx5_*
find "$rec" -name 'wqe-*.bin' | sort | while read -r f; do
  b="$(basename "$f" .bin)"
  cp "$f" "$wqes/libmlx5_${b#wqe-}"
done
echo "$(ls "$wqes" | grep -c '^libmlx5_') libmlx5 WQEs in $wqes"
python3 - "$rec" "$out" <<'PY'
import glob, os, sys
rec, out = sys.argv[1], sys.argv[2]
LIMIT = 16384
for path in sorted(glob.glob(os.path.join(rec, "*.s"))):
    name = os.path.basename(path)[:-2]
    data = open(path, "rb").read()
    chunks, cur, i = [], b"", 0
    while i + 3 <= len(data):
        n = int.from_bytes(data[i + 1:i + 3], "big")
        record = data[i:i + 3 + n]
        i += 3 + n
        if cur and len(cur) + len(record) > LIMIT:
            chunks.append(cur)
            cur = b""
        cur += record
    if cur:
        chunks.append(cur)
    for k, c in enumerate(chunks):
        open(os.path.join(out, f"{name}_{k:02}"), "wb").write(c)
print(f"{len(os.listdir(out))} seeds in {out}")
PY
