#!/usr/bin/env bash
# The soft NIC's GPU memory, two builds side by side in one run on the GPU machine (issue 45
# item 2; timings count only as ratios within one run, on one card): each build's
# `devmem_bench --json` (its copies against the driver's, its in-process WRITE/READ), then with
# the GPU initiator `write_lat` with host memory, GPU memory and GPU rings, and `put_bw` /
# `read_bw` on GPU memory, in one process (--loopback) and across two (a server and a client on
# 127.0.0.1, under MPS), the builds alternating case by case.
#
# usage: devmem_ab.sh BASE_BIN NEW_BIN
#   each BIN holds devmem_bench, write_lat, put_bw and read_bw of one build
# Environment: LOG (default /tmp/devmem-ab), ROUNDS (default 2: each case this many times per
# build, alternating).
# Prints one line per measurement: `ab BUILD CASE KEY=VALUE`, and the devmem_bench JSON lines
# prefixed with `devmem BUILD`.
set -uo pipefail
base=$(realpath "$1") new=$(realpath "$2")
log=${LOG:-/tmp/devmem-ab}
mkdir -p "$log"
rounds=${ROUNDS:-2}
port=19400
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u

for b in base new; do
    dir=$base
    [ "$b" = new ] && dir=$new
    timeout 120 "$dir/devmem_bench" --json 2>"$log/devmem_$b.err" | sed "s/^/devmem $b /"
done

# field FILE KEY: KEY's value in the last JSON row of FILE.
field() {
    grep '^{' "$1" | tail -n 1 | python3 -c "import sys,json; print(json.load(sys.stdin).get('$2'))" \
        2>/dev/null
}

# one BUILD NAME KEY BIN ARGS...: one process, both sides.
one() {
    local b=$1 name=$2 key=$3 exe=$4
    shift 4
    local dir=$base
    [ "$b" = new ] && dir=$new
    local out="$log/$b.$name.out"
    if timeout 120 "$dir/$exe" --loopback --initiator gpu --json "$@" >"$out" 2>"$out.err"; then
        echo "ab $b $name $key=$(field "$out" "$key") validated=$(grep -c '"validated":true' "$out")"
    else
        echo "ab $b $name FAILED ($(tail -n 1 "$out.err"))"
    fi
}

# two BUILD NAME KEY BIN ARGS...: a server and a client process.
two() {
    local b=$1 name=$2 key=$3 exe=$4
    shift 4
    local dir=$base
    [ "$b" = new ] && dir=$new
    port=$((port + 1))
    local s="$log/$b.$name.server" c="$log/$b.$name.client"
    timeout 120 "$dir/$exe" -p "$port" --timeout 60 --initiator gpu --json "$@" >"$s.out" \
        2>"$s.err" &
    local server=$!
    sleep 0.5
    timeout 120 "$dir/$exe" 127.0.0.1 -p "$port" --initiator gpu --json "$@" >"$c.out" 2>"$c.err"
    local rc=$?
    wait "$server"
    if [ "$rc" -eq 0 ]; then
        echo "ab $b $name $key=$(field "$c.out" "$key") validated=$(grep -c '"validated":true' "$c.out")"
    else
        echo "ab $b $name FAILED ($(tail -n 1 "$c.err"))"
    fi
}

cases() {
    local b=$1
    one "$b" write_lat_host_8 t_typical_us write_lat -s 8 -n 2000
    one "$b" write_lat_gpumem_8 t_typical_us write_lat -s 8 -n 2000 --mem gpu
    one "$b" write_lat_gpurings_8 t_typical_us write_lat -s 8 -n 2000 --rings gpu
    one "$b" write_lat_host_4k t_typical_us write_lat -s 4096 -n 2000
    one "$b" write_lat_gpumem_4k t_typical_us write_lat -s 4096 -n 2000 --mem gpu
    one "$b" put_bw_gpumem_64k bw_average put_bw -s 65536 -n 500 --mem gpu
    one "$b" put_bw_gpumem_1m bw_average put_bw -s 1048576 -n 100 --mem gpu
    one "$b" read_bw_gpumem_1m bw_average read_bw -s 1048576 -n 100 --mem gpu
    two "$b" write_lat_2p_host_8 t_typical_us write_lat -s 8 -n 2000
    two "$b" write_lat_2p_gpumem_8 t_typical_us write_lat -s 8 -n 2000 --mem gpu
    two "$b" write_lat_2p_gpumem_4k t_typical_us write_lat -s 4096 -n 2000 --mem gpu
    two "$b" put_bw_2p_gpumem_64k bw_average put_bw -s 65536 -n 500 --mem gpu
    two "$b" put_bw_2p_gpumem_1m bw_average put_bw -s 1048576 -n 100 --mem gpu
    two "$b" put_bw_2p_host_1m bw_average put_bw -s 1048576 -n 100
}

mps_started=0
if [ "${MPS:-1}" != 0 ] && command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=$log/mps-pipe CUDA_MPS_LOG_DIRECTORY=$log/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps_started=1
fi
for _ in $(seq "$rounds"); do
    cases base
    cases new
done
if [ "$mps_started" = 1 ]; then
    echo quit | nvidia-cuda-mps-control
fi
date -u
