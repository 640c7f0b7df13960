#!/usr/bin/env bash
# gpu-check.sh: the one script that checks the CUDA backend on the GPU machine.
#
# Run from the repository root there: `bash scripts/gpu-check.sh [BIN_DIR]` (default .devbin/cuda,
# or the folder this script sits in when that holds the binaries). The binaries are built on the
# CPU machine (no Rust on the GPU machine):
#   cargo test --release --no-run -p meddpm-cuda --message-format=json   (parity, kernels_compile)
#   cargo build --release -p meddpm-cuda --examples                     (doctor, bench_primitives)
# and copied into BIN_DIR under those names (scripts/gpu-prepare.sh does it).
#
# It (1) makes a private library folder whose `libcudnn.so` points at PyTorch's cuDNN 9.19 and puts
# it first in LD_LIBRARY_PATH — /usr/local/cuda/lib64 holds an older cuDNN 9.14 as `libcudnn.so`,
# which cudarc would otherwise load (see ../shared/docs/gpu-machine.md); (2) prints the doctor
# report; (3) runs the parity tests; (4) runs the micro-benchmarks; (5) prints a short table last.
# Full logs go to $OUT (or ./gpu-check-out).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-}
if [ -z "$BIN" ]; then
  if [ -x "$HERE/parity" ]; then BIN=$HERE; else BIN=.devbin/cuda; fi
fi
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"

SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib
mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export MEDDPM_CACHE_DIR=${MEDDPM_CACHE_DIR:-/tmp/meddpm-cache}

{
  echo "== nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  echo "== doctor"
  "$BIN/doctor"
} 2>&1 | tee "$OUT/doctor.log"

status=0
echo "== kernels_compile" | tee "$OUT/parity.log"
"$BIN/kernels_compile" --nocapture 2>&1 | tee -a "$OUT/parity.log" | tail -3
echo "== parity" | tee -a "$OUT/parity.log"
t0=$(date +%s)
# the parity tests are #[ignore]d (a plain `cargo test` without a GPU reports them as ignored)
timeout ${PARITY_TIMEOUT:-300} "$BIN/parity" --include-ignored --nocapture --test-threads=1 >>"$OUT/parity.log" 2>&1 || status=1
echo "parity took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/parity.log"
grep -E "^test |test result|NOT OK|panicked" "$OUT/parity.log" | tail -40

echo "== bench" | tee "$OUT/bench.log"
timeout ${BENCH_TIMEOUT:-240} "$BIN/bench_primitives" "$OUT" "${BENCH_ITERS:-10}" 2>&1 | tee -a "$OUT/bench.log" | tail -30 >/dev/null
cp -f "$MEDDPM_CACHE_DIR"/cudnn-algos-*.txt "$OUT/" 2>/dev/null || true

echo
echo "== summary"
grep -E "cuDNN:|^device 0|driver:" "$OUT/doctor.log"
grep -E "test result" "$OUT/parity.log"
grep -E "^\| " "$OUT/bench.log"
exit $status
