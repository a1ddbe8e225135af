#!/usr/bin/env bash
# CTA-scaling put bandwidth (the experiment NVSHMEM's shmem_put_bw runs), on put_bw's GPU
# initiator in loopback: one thread and one QP per CTA (`-q N`: CTA c drives QP c), CTAs
# 1 .. 64 (put_bw's QP limit), message sizes swept (one run per size, the iterations scaled so
# that each run moves at most 256 MiB per QP set), GPU doorbell against CPU proxy, every byte
# validated.
# Shows where the CPU proxy becomes the bottleneck and where GPU-initiated puts reach peak
# bandwidth at smaller sizes.
#
# Usage: samples/scripts/cta_scaling.sh OUTDIR [PUT_BW] [GPUVERBS]
#   OUTDIR     gets put_bw_<db>_<ctas>.json (the rows of `put_bw --json`), cta_scaling.json
#              (all rows, one per line) and, with GPUVERBS, cta_scaling_<db>.svg
#              (`gpuverbs plot bw`, one series per CTA count)
#   PUT_BW     the put_bw binary (default: target/release/put_bw)
#   GPUVERBS   the gpuverbs binary for the plots (default: none, no plots)
# Environment: CTAS (default "1 2 4 8 16 32 64"), DBS (default "gpu proxy"), SIZES (default
# "8 64 512 4096 32768 262144 1048576"), ITERS (at most, default 2000), POST_LIST (-l, 16).
# Prints a table per doorbell mode: average MB/s, rows CTAs, columns sizes.
set -euo pipefail
out=${1:?usage: cta_scaling.sh OUTDIR [PUT_BW] [GPUVERBS]}
put_bw=${2:-target/release/put_bw}
gpuverbs=${3:-}
ctas=${CTAS:-1 2 4 8 16 32 64}
sizes=${SIZES:-8 64 512 4096 32768 262144 1048576}
dbs=${DBS:-gpu proxy}
iters=${ITERS:-2000}
post_list=${POST_LIST:-16}  # WQEs per doorbell (the figures in docs/benchmarks.md: 16)
mkdir -p "$out"
: > "$out/cta_scaling.json"
for db in $dbs; do
  for n in $ctas; do
    f="$out/put_bw_${db}_${n}.json"
    : > "$f"
    for s in $sizes; do
      it=$(( (256 << 20) / (s * n) ))
      (( it > iters )) && it=$iters
      (( it < 20 )) && it=20
      "$put_bw" --loopback --initiator gpu --db "$db" -q "$n" -s "$s" -n "$it" -l "$post_list" --json \
        2>/dev/null | grep '^{' >> "$f"
    done
    cat "$f" >> "$out/cta_scaling.json"
  done
done
python3 - "$out" "$dbs" "$ctas" "$sizes" <<'EOF'
import json, sys
out, dbs = sys.argv[1], sys.argv[2].split()
ctas, sizes = [int(c) for c in sys.argv[3].split()], [int(s) for s in sys.argv[4].split()]
name = lambda s: f"{s >> 20}M" if s >= 1 << 20 else f"{s >> 10}K" if s >= 1024 else str(s)
rows = [json.loads(l) for l in open(f"{out}/cta_scaling.json")]
for db in dbs:
    mode = {"gpu": "gpu-doorbell", "proxy": "cpu-proxy"}.get(db, db)
    print(f"put_bw --loopback --initiator gpu --db {db}: average MB/sec, one thread and one QP per CTA")
    print("  CTAs " + "".join(f"{name(s):>10}" for s in sizes))
    for n in ctas:
        got = {r["bytes"]: r for r in rows if r["doorbell"] == mode and r["qps"] == n}
        bad = [r["bytes"] for r in got.values() if not r.get("validated")]
        if bad:
            sys.exit(f"--db {db} -q {n}: not validated at {bad}")
        cells = "".join(f"{got[s]['bw_average']:>10.0f}" if s in got else f"{'-':>10}" for s in sizes)
        print(f"{n:>6} {cells}")
    print()
EOF
if [[ -n $gpuverbs ]]; then
  for db in $dbs; do
    files=() labels=()
    for n in $ctas; do files+=("$out/put_bw_${db}_${n}.json"); labels+=(--label "$n CTAs"); done
    "$gpuverbs" plot bw "${files[@]}" "${labels[@]}" -o "$out/cta_scaling_${db}.svg" \
      --title "put_bw CTA scaling, --db $db (one thread and one QP per CTA)"
  done
fi
