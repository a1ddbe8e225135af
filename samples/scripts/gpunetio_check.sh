#!/usr/bin/env bash
# NVIDIA's own GPUNetIO (github.com/NVIDIA-DOCA/gpunetio, BSD-3; its source is an input of this
# check, never part of this repository) on gpuverbs' emulated ConnectX: builds its host library
# and its verbs examples against this machine's CUDA and rdma-core, then runs
# `gpunetio_verbs_put_bw` and `gpunetio_verbs_write_lat` as server and client, each under its own
# `gpuverbs emu` (addresses 127.0.0.1 and 127.0.0.2), once per NIC handler in $HANDLERS
# (GPUNetIO's `-p`: 1 CPU proxy, 2 GPU doorbell, 6 GPU BlueFlame, which only write_lat has;
# default "1 2 6"; the GPU modes need the UAR page mapped into the GPU as I/O memory, which the
# emulation's preload arranges, docs/emulation.md). put_bw's server checks every byte it received (GPUNetIO's own
# check, on SIGINT); write_lat's ping-pong must finish. A GPU handler must not fall back to the
# CPU proxy ("Enabling CPU proxy mode" in a log fails the case).
# With gpuverbs' samples given, gpuverbs' put_bw and write_lat (two processes each, GPU memory
# through dma-bufs, the examples' message counts) run on the same emulated devices in the same
# call, for the figures beside GPUNetIO's (issue 44 part 4).
#
# usage: gpunetio_check.sh GPUNETIO_TARBALL_OR_DIR GPUVERBS PRELOAD [SAMPLES_DIR]
# prints one line per case and `gpunetio: N passed, M failed`; the examples' tables and logs
# are in $LOG (default /tmp/gpunetio-check).
set -u
src=$1 gpuverbs=$(realpath "$2") preload=$(realpath "$3") samples=${4:-}
log=${LOG:-/tmp/gpunetio-check}
mkdir -p "$log"
passed=0 failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }

work=$log/gpunetio
if [ -d "$src" ]; then
    rm -rf "$work" && cp -r "$src" "$work"
else
    rm -rf "$work" && mkdir -p "$work" && tar -C "$work" --strip-components=1 -xzf "$src"
fi
cd "$work" || exit 1
echo "GPUNetIO: $(cat VERSION 2>/dev/null || echo '?') $(git rev-parse --short HEAD 2>/dev/null || true)"
# serially: the examples link against the library (a parallel make races there)
if make -j16 lib CUDA_HOME=/usr/local/cuda CUDA_ARCH=90 >"$log/build.log" 2>&1 &&
    make examples CUDA_HOME=/usr/local/cuda CUDA_ARCH=90 >>"$log/build.log" 2>&1; then
    ok "build (host library and examples)"
else
    bad "build (see $log/build.log)"
    tail -n 20 "$log/build.log"
    echo "gpunetio: $passed passed, $failed failed"
    exit 1
fi
export LD_LIBRARY_PATH=$work/lib:${LD_LIBRARY_PATH:-} DOCA_GPUNETIO_LOG=6 GPUVERBS_PRELOAD=$preload
gpu=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1)
mps=0
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null; then
    mps=1
fi

# run_pair NAME BIN EXTRA...: server under `gpuverbs emu --ip 127.0.0.1`, client under
# `--ip 127.0.0.2` connecting to it (TCP port 2000, GPUNetIO's), NIC handler $p. Sets $sp
# (server pid).
run_pair() {
    local name=$1 bin=$2
    shift 2
    GPUVERBS_EMU_COUNTERS=$log/$name.server.counters timeout 180 "$gpuverbs" emu --ip 127.0.0.1 \
        -- "$bin" -g "$gpu" -d mlx5_0 -l 0 -p "$p" "$@" >"$log/$name.server" 2>&1 &
    sp=$!
    for _ in $(seq 300); do
        grep -q "Listening for incoming" "$log/$name.server" && break
        kill -0 "$sp" 2>/dev/null || break
        sleep 0.1
    done
    GPUVERBS_EMU_COUNTERS=$log/$name.client.counters timeout 180 "$gpuverbs" emu --ip 127.0.0.2 \
        -- "$bin" -g "$gpu" -d mlx5_0 -l 0 -p "$p" "$@" -c 127.0.0.1 >"$log/$name.client" 2>&1
}

# no_fallback NAME: with a GPU handler, neither side fell back to the CPU proxy.
no_fallback() {
    [ "$p" = 1 ] || ! grep -q "Enabling CPU proxy mode" "$log/$1.server" "$log/$1.client"
}

for p in ${HANDLERS:-1 2 6}; do
echo "NIC handler -p $p:"

b=examples/gpunetio_verbs_put_bw/gpunetio_verbs_put_bw
if [ "$p" = 6 ]; then
    # the example itself refuses it: "NIC handler BlueFlame not supported in this example"
    echo "skip gpunetio_verbs_put_bw -p 6 (the example has no BlueFlame mode)"
else
run_pair "put_bw_p$p" "$b" -i 512
crc=$?
sleep 1
# the server checks what it received when it gets SIGINT: signal the example itself (its
# name as the kernel keeps it, 15 characters), not the `gpuverbs emu` around it
pkill -INT -x gpunetio_verbs_
wait "$sp"
if [ "$crc" = 0 ] && grep -q "Validation successfull" "$log/put_bw_p$p.server" &&
    ! grep -q "Validation error" "$log/put_bw_p$p.server" && no_fallback "put_bw_p$p"; then
    ok "gpunetio_verbs_put_bw -p $p (client rc 0; the server validated every byte)"
else
    bad "gpunetio_verbs_put_bw -p $p (client rc $crc; see $log/put_bw_p$p.*)"
    tail -n 15 "$log/put_bw_p$p.client" "$log/put_bw_p$p.server"
fi
grep -A20 '#bytes' "$log/put_bw_p$p.client" | head -20
cat "$log/put_bw_p$p.client.counters" 2>/dev/null | grep '^cuda'
fi


l=examples/gpunetio_verbs_write_lat/gpunetio_verbs_write_lat
run_pair "write_lat_p$p" "$l" -i 256
crc=$?
wait "$sp"
src_rc=$?
if [ "$crc" = 0 ] && [ "$src_rc" = 0 ] && no_fallback "write_lat_p$p"; then
    ok "gpunetio_verbs_write_lat -p $p (both sides finished the ping-pong)"
else
    bad "gpunetio_verbs_write_lat -p $p (client rc $crc, server rc $src_rc; see $log/write_lat_p$p.*)"
    tail -n 15 "$log/write_lat_p$p.client" "$log/write_lat_p$p.server"
fi
grep -A12 '#bytes' "$log/write_lat_p$p.client" | head -12
done

# gv NAME SAMPLE ARGS...: gpuverbs' SAMPLE as server (127.0.0.1) and client (127.0.0.2) under
# the emulation, GPU initiator, payloads in GPU memory through dma-bufs as GPUNetIO's examples
# keep theirs; prints the client's rows.
gv() {
    local name=$1 s=$2
    shift 2
    timeout 120 "$gpuverbs" emu --ip 127.0.0.1 -- "$samples/$s" -d mlx5_0 -p 18700 \
        --initiator gpu --mem gpu --use_cuda_dmabuf --json "$@" >"$log/gv_$name.server" 2>&1 &
    local gsp=$!
    sleep 2
    timeout 120 "$gpuverbs" emu --ip 127.0.0.2 -- "$samples/$s" -d mlx5_0 -p 18700 \
        --initiator gpu --mem gpu --use_cuda_dmabuf --json "$@" 127.0.0.1 >"$log/gv_$name.client" 2>&1
    local crc=$?
    wait "$gsp"
    grep -h '^{' "$log/gv_$name.client"
    if [ "$crc" = 0 ] && ! grep -q '"validated":false' "$log/gv_$name.client"; then
        ok "gpuverbs $name"
    else
        bad "gpuverbs $name (see $log/gv_$name.*)"
    fi
}
if [ -n "$samples" ]; then
    # the examples' shapes: put_bw 512 messages per size from one thread, write_lat a ping-pong
    echo "gpuverbs on the same emulated devices:"
    for size in 8 4096 65536; do
        gv "put_bw_$size" put_bw -s "$size" -n 512 --scope thread
        gv "write_lat_$size" write_lat -s "$size" -n 256
    done
fi
if [ "$mps" = 1 ]; then
    echo quit | nvidia-cuda-mps-control
fi
echo "gpunetio: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
