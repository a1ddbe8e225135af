#!/usr/bin/env bash
# UCX's tag_lat between two `gpuverbs emu` processes (server 127.0.197.1, client 127.0.197.2),
# 8 bytes, over rc_verbs (completions through ibv_poll_cq, which the emulation sees), rc_mlx5 and
# dc_mlx5 (CQs polled in memory, which it does not). Prints one row per transport and build: the
# client's final median and average latency in µs (ucx_perftest's one-way figure, half a round
# trip). Each TARGET is a cargo target folder holding release builds of gpuverbs and
# libgpuverbs_uverbs_preload.so (this tree's and an older commit's, built with
# CARGO_TARGET_DIR=...), so two builds are compared in one run, interleaved per round.
# Usage: samples/scripts/emu_ucx_lat_bench.sh ROUNDS TARGET...   (ITERS=5000 by default)
set -euo pipefail
rounds=${1:?rounds}
shift
iters=${ITERS:-5000}
out=$(mktemp -d)
trap 'rm -rf "$out"; pkill -f "ucx_perftest -p 19[0-9][0-9][0-9]" || true' EXIT

one() { # target transport
  local target=$1 tl=$2
  port=$((port + 1))
  local g="$target/release/gpuverbs"
  export GPUVERBS_PRELOAD="$target/release/libgpuverbs_uverbs_preload.so"
  export UCX_TLS="$tl,ud_mlx5,self" UCX_NET_DEVICES=mlx5_0:1
  "$g" emu --ip 127.0.197.1 -- ucx_perftest -p "$port" > "$out/server" 2>&1 &
  local spid=$!
  for _ in $(seq 200); do
    grep -q ":$(printf '%04X' "$port") 00000000:0000 0A" /proc/net/tcp && break
    sleep 0.05
  done
  local row
  if timeout 300 "$g" emu --ip 127.0.197.2 -- ucx_perftest 127.0.197.1 -p "$port" \
    -t tag_lat -n "$iters" -s 8 > "$out/client" 2>&1; then
    # Final: iterations median average overall ...
    row=$(awk '$1 == "Final:" { printf "%10s %10s", $3, $4 }' "$out/client")
  else
    row="failed: $(grep -iv '^ *$\|gpuverbs-emu' "$out/client" | head -1)"
  fi
  wait "$spid" 2>/dev/null || kill "$spid" 2>/dev/null || true
  printf '%-10s %-40s %s\n' "$tl" "$target" "$row"
}

port=19000
printf '%-10s %-40s %10s %10s\n' transport build median average
for r in $(seq "$rounds"); do
  for target in "$@"; do
    for tl in rc_verbs rc_mlx5 dc_mlx5; do
      one "$target" "$tl"
    done
  done
done
