#!/usr/bin/env bash
# Debian's perftest on the emulated device (`gpuverbs emu`: the real libibverbs + libmlx5 over the
# soft NIC) next to gpuverbs' own samples on the soft NIC, on the same machine, interleaved:
#   ib_write_bw -a and ib_send_bw -a  vs  put_bw -a --initiator cpu   (server and client processes)
#   ib_write_lat -a                   vs  write_lat -a --initiator cpu
#   ib_read_bw -a, ib_send_bw -a, ib_atomic_bw  vs  read_bw -a, send_bw -a, atomic_bw (--initiator cpu)
#   ib_read_lat -a, ib_send_lat -a, ib_atomic_lat  vs  read_lat -a, send_lat -a, atomic_lat
# Each round runs every program once; the table is the median over rounds per size, with the
# ratio perftest / gpuverbs. Release builds. Usage: samples/scripts/emu_perftest_bench.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
iters=${ITERS:-200}
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
cargo build -q --release -p gpuverbs-command -p gpuverbs-uverbs-preload -p gpuverbs-samples \
  --bin gpuverbs --lib --bin put_bw --bin write_lat --bin read_bw --bin send_bw --bin atomic_bw \
  --bin read_lat --bin send_lat --bin atomic_lat
G="$target/release/gpuverbs"
export GPUVERBS_PRELOAD="$target/release/libgpuverbs_uverbs_preload.so"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

pair() { # name port server-cmd... ::: client-cmd...
  local name=$1 port=$2; shift 2
  local server=() client=()
  while [[ $1 != ::: ]]; do server+=("$1"); shift; done; shift
  client=("$@")
  "${server[@]}" > "$out/$name.server" 2>&1 &
  local spid=$!
  for _ in $(seq 200); do
    grep -q ":$(printf '%04X' "$port") 00000000:0000 0A" /proc/net/tcp && break
    sleep 0.05
  done
  "${client[@]}" >> "$out/$name.client" 2>&1
  wait "$spid"
}

for r in $(seq "$rounds"); do
  echo "round $r/$rounds" >&2
  for t in write send; do
    pair "ib_${t}_bw" 18900 "$G" emu --ip 127.0.0.1 -- "ib_${t}_bw" -x 0 -a -F -n "$iters" -p 18900 ::: \
      "$G" emu --ip 127.0.0.2 -- "ib_${t}_bw" -x 0 -a -F -n "$iters" -p 18900 127.0.0.1
  done
  pair put_bw 18901 "$target/release/put_bw" --initiator cpu -a -n "$iters" -p 18901 ::: \
    "$target/release/put_bw" --initiator cpu -a -n "$iters" -p 18901 127.0.0.1
  pair ib_write_lat 18902 "$G" emu --ip 127.0.0.1 -- ib_write_lat -x 0 -a -F -n "$iters" -p 18902 ::: \
    "$G" emu --ip 127.0.0.2 -- ib_write_lat -x 0 -a -F -n "$iters" -p 18902 127.0.0.1
  pair write_lat 18903 "$target/release/write_lat" --initiator cpu -a -n "$iters" -p 18903 ::: \
    "$target/release/write_lat" --initiator cpu -a -n "$iters" -p 18903 127.0.0.1
  # perftest's other tests and their samples (atomics: 8 bytes only, no -a).
  port=18904
  for t in read_bw send_bw atomic_bw read_lat send_lat atomic_lat; do
    all=(-a)
    [[ $t == atomic_* ]] && all=()
    pair "ib_$t" "$port" "$G" emu --ip 127.0.0.1 -- "ib_$t" -x 0 "${all[@]}" -F -n "$iters" -p "$port" ::: \
      "$G" emu --ip 127.0.0.2 -- "ib_$t" -x 0 "${all[@]}" -F -n "$iters" -p "$port" 127.0.0.1
    pair "$t" $((port + 1)) "$target/release/$t" --initiator cpu "${all[@]}" -n "$iters" -p $((port + 1)) ::: \
      "$target/release/$t" --initiator cpu "${all[@]}" -n "$iters" -p $((port + 1)) 127.0.0.1
    port=$((port + 2))
  done
done

python3 - "$out" "$(git rev-parse --short HEAD)" <<'PY'
import statistics, sys, pathlib
d = pathlib.Path(sys.argv[1])
def table(name, col):
    rows = {}
    for line in (d / f"{name}.client").read_text().splitlines():
        f = line.split()
        if len(f) > col and f[0].isdigit():
            try:
                rows.setdefault(int(f[0]), []).append(float(f[col]))
            except ValueError:
                pass
    return {k: statistics.median(v) for k, v in rows.items()}
bw = {n: table(n, 3) for n in ("ib_write_bw", "ib_send_bw", "put_bw")}
lat = {n: table(n, 4) for n in ("ib_write_lat", "write_lat")}
print(f"commit {sys.argv[2]}; BW average MB/s, medians")
print("| bytes | ib_write_bw | ib_send_bw | put_bw (cpu) | write / put_bw | send / put_bw |")
print("|---|---|---|---|---|---|")
for s in sorted(set(bw["put_bw"]) & set(bw["ib_write_bw"])):
    w, sb, p = bw["ib_write_bw"].get(s), bw["ib_send_bw"].get(s), bw["put_bw"][s]
    f = lambda v: f"{v:.1f}" if v is not None else "-"
    r = lambda v: f"{v / p:.2f}" if v is not None and p else "-"
    print(f"| {s} | {f(w)} | {f(sb)} | {f(p)} | {r(w)} | {r(sb)} |")
print()
print("typical latency µs, medians")
print("| bytes | ib_write_lat | write_lat (cpu) | ratio |")
print("|---|---|---|---|")
for s in sorted(set(lat["ib_write_lat"]) & set(lat["write_lat"])):
    a, b = lat["ib_write_lat"][s], lat["write_lat"][s]
    print(f"| {s} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
# READ, SEND, atomics: perftest's test next to the sample of the same verb.
for t, col, what in [
    ("read_bw", 3, "BW average MB/s"), ("send_bw", 3, "BW average MB/s"),
    ("atomic_bw", 3, "BW average MB/s"), ("read_lat", 4, "typical latency µs"),
    ("send_lat", 4, "typical latency µs"), ("atomic_lat", 4, "typical latency µs"),
]:
    p, g = table(f"ib_{t}", col), table(t, col)
    print()
    print(f"ib_{t} vs {t} (cpu): {what}, medians")
    print(f"| bytes | ib_{t} | {t} (cpu) | ratio |")
    print("|---|---|---|---|")
    for s in sorted(set(p) & set(g)):
        r = f"{p[s] / g[s]:.2f}" if g[s] else "-"
        print(f"| {s} | {p[s]:.2f} | {g[s]:.2f} | {r} |")
PY
