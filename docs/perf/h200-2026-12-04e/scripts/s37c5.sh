# s37 call 5: ex3 = HEAD + MEDDPM_DIAG_DEFS; EARLY: the producer transforms and hands over each stage as
# soon as its copies land, then waits for the next free buffer (HEAD: waits for the buffer first)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
BIN_DIR=.devbin/${BINNAME:-ex3} source scripts/gpu/bins.sh
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
if [ -n "${TESTS:-}" ]; then
  t0=$(date +%s)
  MEDDPM_DIAG_DEFS=${TESTDEFS:-} CUDA_MODULE_LOADING=EAGER MEDDPM_CACHE_DIR=/tmp/cache-${TESTARM:-x} timeout 200 "$BIN/parity_bf16" --test-threads=1 $TESTS > $L/tests.log 2>&1
  echo "[tests defs=${TESTDEFS:-} rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^test |test result|panicked" $L/tests.log | head -20 >> "$OUT/summary.txt"
fi
arm() {
  local name=$1 defs=$2 preset=$3 round=$4 iters=$5
  local t0=$(date +%s)
  MEDDPM_CONV_LOG=${CONVLOG:-0} MEDDPM_DIAG_DEFS=$defs MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 200 "$BIN/meddpm" bench --device cuda --preset $preset \
    --precision bf16 --layout ndhwc --iters $iters --json "$L/$name-$preset-$round.json" > "$L/$name-$preset-$round.log" 2>&1
  echo "[$name $preset r$round defs=$defs rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^bench: bf16|^power|^error" "$L/$name-$preset-$round.log" | head -3 >> "$OUT/summary.txt"
}
ARMS=${ARMS:-base: early:EARLY}
CONVLOG=1; for a in $ARMS; do arm "${a%%:*}" "${a#*:}" brats 1 7; done
CONVLOG=0
for r in 2 3; do for a in $ARMS; do arm "${a%%:*}" "${a#*:}" brats $r 7; done; done
for r in 1 2; do for a in $ARMS; do arm "${a%%:*}" "${a#*:}" whole-head $r 11; done; done
tar -C /tmp -czf "$OUT/logs.tar.gz" logs
cat "$OUT/summary.txt"
