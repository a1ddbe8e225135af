#!/usr/bin/env bash
# A/B of NVSHMEM's IBRC transport on two builds of the emulation (issue 45 item 2's NVSHMEM aim:
# 8 KiB puts >= 4x a base's): nvshmem_check.sh with TRANSPORT=ibrc MODE=bench, ROUNDS times on
# each build, the order flipping every round (base first in odd rounds); nvshmem_check built once.
# Then one line per put-rate row (size, CTAs x threads) and per ping-pong size: the medians of
# base and new, and new's rate over base's (for the round trip: base's time over new's).
#
# usage: nvshmem_ibrc_ab.sh ROUNDS BASE_DIR NEW_DIR
#   each DIR holds `gpuverbs` and `libgpuverbs_uverbs_preload.so`; logs in $LOG (default
#   /tmp/nvshmem-ibrc-ab): SIDE.ROUND.txt (the script's output), SIDE.ROUND/ (its logs).
set -u
[ $# -eq 3 ] || { echo "usage: $0 ROUNDS BASE_DIR NEW_DIR" >&2; exit 2; }
rounds=$1 base=$(realpath "$2") new=$(realpath "$3")
here=$(dirname "$(realpath "$0")")
out=${LOG:-/tmp/nvshmem-ibrc-ab}
mkdir -p "$out" && rm -f "$out"/base.*.txt "$out"/new.*.txt
LOG=$out MODE=build bash "$here/nvshmem_check.sh" "$base/gpuverbs" \
    "$base/libgpuverbs_uverbs_preload.so" || exit 1
for i in $(seq "$rounds"); do
    order="base new"
    [ $((i % 2)) = 0 ] && order="new base"
    for side in $order; do
        dir=$base
        [ "$side" = new ] && dir=$new
        LOG=$out/$side.$i TRANSPORT=ibrc MODE=bench bash "$here/nvshmem_check.sh" "$dir/gpuverbs" \
            "$dir/libgpuverbs_uverbs_preload.so" "$out/nvshmem_check" >"$out/$side.$i.txt" 2>&1
        echo "round $i $side: $(grep -E '^(ok|FAIL)' "$out/$side.$i.txt" | tr '\n' ' ')$(grep \
            '"size":8192,"ctas":1,"threads":1,' "$out/$side.$i.txt")"
    done
done
python3 - "$out" <<'EOF'
import glob, json, statistics, sys
rows = {}  # (bench, size, ctas, threads) -> side -> [(us per put or round trip, MB/s or None)]
for side in ("base", "new"):
    for f in glob.glob(f"{sys.argv[1]}/{side}.*.txt"):
        for line in open(f):
            if not line.startswith('{"bench":"nvshmem_put_'):
                continue
            r = json.loads(line)
            if r["bench"] == "nvshmem_put_rate":
                v = (r["us_per_put"], r["mbps"])
            elif r["bench"] == "nvshmem_put_signal_rtt" and r["validated"]:
                v = (r["rtt_us"], None)
            else:
                continue
            k = (r["bench"], r["size"], r.get("ctas", 1), r.get("threads", 1))
            rows.setdefault(k, {"base": [], "new": []})[side].append(v)
for (bench, size, ctas, threads), s in sorted(rows.items()):
    if not s["base"] or not s["new"]:
        print(f"{bench} {size} B {ctas}x{threads}: base {len(s['base'])} rows, new {len(s['new'])}")
        continue
    b = statistics.median(x[0] for x in s["base"])
    n = statistics.median(x[0] for x in s["new"])
    if bench == "nvshmem_put_rate":
        bm = statistics.median(x[1] for x in s["base"])
        nm = statistics.median(x[1] for x in s["new"])
        print(f"put_rate {size:>5} B {ctas}x{threads:<2}: base {b:8.3f} us/put {bm:8.1f} MB/s, "
              f"new {n:8.3f} us/put {nm:8.1f} MB/s, new/base {nm / bm:.2f}x "
              f"(medians of {len(s['base'])}/{len(s['new'])})")
    else:
        print(f"put_signal_rtt {size:>5} B: base {b:8.2f} us, new {n:8.2f} us, base/new {b / n:.2f}x "
              f"(medians of {len(s['base'])}/{len(s['new'])})")
EOF
