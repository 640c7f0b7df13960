# s38 call 5: main (19a930e, .devbin/m38): the fp32/TF32 parity suite and the golden files on the GPU
# (each line of the summary is written as it finishes, so a cut call still reports what ran)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
BIN_DIR=.devbin/${BINNAME:-m38} source scripts/gpu/bins.sh
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export MEDDPM_CACHE_DIR=/tmp/cache-m38
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader >> "$OUT/summary.txt"
for t in ${SUITES:-parity golden}; do
  t0=$(date +%s)
  CUDA_MODULE_LOADING=EAGER timeout 300 "$BIN/$t" --test-threads=1 > "$OUT/$t.log" 2>&1
  echo "[$t rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^test result|panicked|FAILED" "$OUT/$t.log" | head -8 >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
