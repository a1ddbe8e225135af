#!/usr/bin/env bash
# Debian's perftest latency tests between two `gpuverbs emu` processes (server 127.0.0.1, client
# 127.0.0.2), 8 bytes: ib_write_lat, ib_send_lat and ib_read_lat busy-polling, and ib_send_lat -e
# (completion events). Prints one row per test and build: t_min, t_typical, t_avg and the 99%
# percentile in µs, from the client. Each TARGET is a cargo target folder holding release builds
# of gpuverbs and libgpuverbs_uverbs_preload.so (e.g. this tree's and an older commit's, built
# with CARGO_TARGET_DIR=...), so two builds are compared in one run, interleaved per round.
# Usage: samples/scripts/emu_latency_bench.sh ROUNDS TARGET...   (ITERS=5000 by default)
set -euo pipefail
rounds=${1:?rounds}
shift
iters=${ITERS:-5000}
out=$(mktemp -d)
trap 'rm -rf "$out"; pkill -f "ib_.*_lat -x 0 -s 8" || true' EXIT

one() { # target tool extra-args...
  local target=$1 tool=$2; shift 2
  # a port of its own per run (perftest's listener may still be closing)
  port=$((port + 1))
  local g="$target/release/gpuverbs"
  export GPUVERBS_PRELOAD="$target/release/libgpuverbs_uverbs_preload.so"
  "$g" emu --ip 127.0.0.1 -- "$tool" -x 0 -s 8 -n "$iters" -p "$port" "$@" > "$out/server" 2>&1 &
  local spid=$!
  for _ in $(seq 200); do
    grep -q ":$(printf '%04X' "$port") 00000000:0000 0A" /proc/net/tcp && break
    sleep 0.05
  done
  local row
  if timeout 300 "$g" emu --ip 127.0.0.2 -- "$tool" -x 0 -s 8 -n "$iters" -p "$port" "$@" 127.0.0.1 \
    > "$out/client" 2>&1; then
    # #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
    row=$(awk '$1 == 8 && NF >= 9 { printf "%10s %10s %10s %10s", $3, $5, $6, $8 }' "$out/client")
  else
    row="failed: $(grep -v '^ *$' "$out/client" | grep -iv 'gid\|address\|---' | head -1)"
  fi
  kill "$spid" 2>/dev/null || true
  wait "$spid" 2>/dev/null || true
  printf '%-24s %-40s %s\n' "$tool $*" "$target" "$row"
}

port=18950
printf '%-24s %-40s %10s %10s %10s %10s\n' test build t_min t_typical t_avg p99
for r in $(seq "$rounds"); do
  for target in "$@"; do
    one "$target" ib_write_lat
    one "$target" ib_send_lat
    one "$target" ib_read_lat
    one "$target" ib_send_lat -e
  done
done
