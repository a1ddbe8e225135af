#!/usr/bin/env bash
# Cross-process put_bw over the soft NIC's wire (two processes on 127.0.0.1, CPU initiator):
# 64 MiB of 1 MiB RDMA WRITEs (-s 1M -n 64) at 0%, 1% and 5% injected loss (both sides),
# interleaved: ROUNDS rounds of (0%, 1%, 5%). Prints one line per run (client's average
# bandwidth and wire counters) and, per loss, the median and its ratio to the clean median.
# Usage: samples/scripts/wire_loss_bench.sh [ROUNDS] [BIN_DIR]   (release binaries)
set -euo pipefail
ROUNDS=${1:-5}
B=${2:-${CARGO_TARGET_DIR:-target}/release}
PORT=${PORT:-18740}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
run() { # loss round
    local loss=$1 r=$2 extra=()
    [ "$loss" != 0 ] && extra=(--loss "$loss")
    local p=$((PORT + r * 3 + ${loss%%.*}))
    "$B/put_bw" --initiator cpu -s 1M -n 64 -p "$p" --json "${extra[@]}" >"$OUT/s" 2>"$OUT/se" &
    local srv=$!
    sleep 0.3
    timeout 120 "$B/put_bw" --initiator cpu -s 1M -n 64 -p "$p" --json "${extra[@]}" 127.0.0.1 \
        >"$OUT/c" 2>"$OUT/ce" || { echo "client failed:"; cat "$OUT/ce"; }
    wait "$srv" || { echo "server failed:"; cat "$OUT/se"; }
    jq -c --arg loss "$loss" '{loss: ($loss|tonumber), mb_s: .bw_average,
        retransmits: .wire.retransmits, timeouts: .wire.timeouts,
        drops: .wire.injected_drops, naks_rx: .wire.seq_naks_received,
        tx_packets: .wire.tx_packets, validated}' "$OUT/c" | tee -a "$OUT/all"
}
for r in $(seq 1 "$ROUNDS"); do
    for loss in 0 1 5; do run "$loss" "$r"; done
done
jq -s -r '
  def median: sort | if length % 2 == 1 then .[length/2|floor]
              else (.[length/2 - 1] + .[length/2]) / 2 end;
  (map(select(.loss == 0) | .mb_s) | median) as $clean
  | group_by(.loss)[]
  | (map(.mb_s) | median) as $m
  | "loss \(.[0].loss)%: median \($m|floor) MB/sec (\($m * 1048576 / 1e9 * 100 | floor / 100) GB/s), \(($m / $clean * 100) | floor)% of clean; runs \(map(.mb_s|floor)); retransmits \(map(.retransmits))"
' "$OUT/all"
