# s37 call 4: HEAD (8c3a4a4, .devbin/xf): the whole parity_bf16 suite, then CUPTI profiles of BraTS and
# whole-head bf16 NDHWC (with the per-pass power lines)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
BIN_DIR=.devbin/xf source scripts/gpu/bins.sh
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export MEDDPM_CACHE_DIR=/tmp/cache-xf
t0=$(date +%s)
CUDA_MODULE_LOADING=EAGER timeout 330 "$BIN/parity_bf16" --test-threads=1 --nocapture > "$OUT/tests.log" 2>&1
echo "[parity_bf16 rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
grep -E "^test result|panicked|FAILED" "$OUT/tests.log" | head -8 >> "$OUT/summary.txt"
grep -cE "^test .* ok$" "$OUT/tests.log" >> "$OUT/summary.txt"
BIN_DIR=.devbin/xf PROF_PRESETS="${PROF_PRESETS:-brats whole-head}" OUT="$OUT" bash scripts/gpu/run.sh prof > /dev/null 2>&1
echo "[prof rc=$?]" >> "$OUT/summary.txt"
mkdir -p /tmp/pr && tar -C /tmp/pr -xzf "$OUT/prof.tar.gz" 2>/dev/null
for f in $(find /tmp/pr -name report.md); do
  echo "== $f" >> "$OUT/summary.txt"
  grep -E "^\| (train step|sampling step)" "$f" | head -4 | cut -c1-200 >> "$OUT/summary.txt"
  grep -A8 -i "clock and power" "$f" | head -10 >> "$OUT/summary.txt"
done
gzip -f "$OUT/tests.log"; rm -rf "$OUT/cache"
cat "$OUT/summary.txt"
