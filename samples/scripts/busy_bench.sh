#!/usr/bin/env bash
# The main job's small-message rate with and without one other busy process (issue 12, item
# 13): `put_bw --loopback --initiator cpu -s 8` (soft NIC, both sides in this process),
# ROUNDS rounds of (quiet, busy), interleaved; "busy" is one shell loop spinning on a core
# for the whole run. Prints each run's message rate and the other processes' CPU during it
# (other_cpu_cores), then the medians and busy/quiet.
# Usage: samples/scripts/busy_bench.sh [ROUNDS] [BIN_DIR] [put_bw args...]  (release binaries)
set -euo pipefail
ROUNDS=${1:-5}
B=${2:-${CARGO_TARGET_DIR:-target}/release}
shift $(($# < 2 ? $# : 2))
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(-s 8 -n 200000)
OUT=$(mktemp -d)
BUSY=
trap '[ -n "$BUSY" ] && kill "$BUSY" 2>/dev/null; rm -rf "$OUT"' EXIT
run() { # quiet|busy
    if [ "$1" = busy ]; then
        sh -c 'while :; do :; done' &
        BUSY=$!
        sleep 0.2
    fi
    "$B/put_bw" --loopback --initiator cpu --json "${ARGS[@]}" >"$OUT/r" 2>"$OUT/e" \
        || { echo "put_bw failed:"; cat "$OUT/e"; }
    if [ -n "$BUSY" ]; then
        kill "$BUSY"
        wait "$BUSY" 2>/dev/null || true
        BUSY=
    fi
    jq -c --arg m "$1" '{mode: $m, mpps: .msg_rate_mpps, mb_s: .bw_average,
        other_cpu_cores, validated}' "$OUT/r" | tee -a "$OUT/all"
}
for _ in $(seq 1 "$ROUNDS"); do
    run quiet
    run busy
done
jq -s -r '
  def median: sort | if length % 2 == 1 then .[length/2|floor]
              else (.[length/2 - 1] + .[length/2]) / 2 end;
  (map(select(.mode == "quiet") | .mpps) | median) as $q
  | (map(select(.mode == "busy") | .mpps) | median) as $b
  | "quiet: median \($q * 1000 | floor / 1000) Mpps; busy: median \($b * 1000 | floor / 1000) Mpps; quiet/busy = \(($q / $b) * 100 | floor / 100)"
' "$OUT/all"
