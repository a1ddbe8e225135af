#!/usr/bin/env bash
# put_bw at 8 B (CPU initiator, loopback, soft NIC), quiet and next to a CPU hog, interleaved:
# ROUNDS times "quiet run, then a run with one busy process (`yes > /dev/null`)". One JSON line
# per run on stdout, with "load": "quiet" | "hog" added; then the median message rate of each
# and their ratio. A benchmark, not a test: it asserts nothing.
#
#   cargo build --release -p gpuverbs-samples --bin put_bw
#   samples/bench/put_bw_hog.sh [ROUNDS] [ITERS]       # defaults: 5 rounds, 500000 messages
#
# PUT_BW overrides the binary ($CARGO_TARGET_DIR/release/put_bw, else target/release/put_bw).
set -euo pipefail
rounds=${1:-5}
iters=${2:-500000}
bin=${PUT_BW:-${CARGO_TARGET_DIR:-target}/release/put_bw}
[ -x "$bin" ] || { echo "no $bin: cargo build --release -p gpuverbs-samples --bin put_bw" >&2; exit 2; }
out=$(mktemp)
hog=
trap '[ -n "$hog" ] && kill "$hog" 2>/dev/null; rm -f "$out"' EXIT
one() {
    "$bin" --loopback --initiator cpu -s 8 -n "$iters" --json 2>/dev/null |
        sed "s/^{/{\"load\":\"$1\",/" | tee -a "$out"
}
for _ in $(seq "$rounds"); do
    one quiet
    yes > /dev/null &
    hog=$!
    one hog
    kill "$hog"
    wait "$hog" 2>/dev/null || true
    hog=
done
python3 - "$out" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
med = {}
for load in ("quiet", "hog"):
    r = [v["msg_rate_mpps"] for v in runs if v["load"] == load]
    o = [v["other_cpu_cores"] for v in runs if v["load"] == load and v["other_cpu_cores"] is not None]
    med[load] = statistics.median(r)
    print(f"# {load}: median {med[load]:.3f} Mpps (min {min(r):.3f}, max {max(r):.3f}, n={len(r)}); "
          f"other processes {min(o, default=0):.2f}-{max(o, default=0):.2f} cores", file=sys.stderr)
print(f"# quiet / hog: {med['quiet'] / med['hog']:.2f}x", file=sys.stderr)
PY
