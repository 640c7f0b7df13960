# Session 39, call 5: the full-size PyTorch comparison (scripts/gpu/torch_full.sh) in every
# precision × layout: whole-head and BraTS .pt checkpoints with random weights, PyTorch's float32
# forward against meddpm's fp32 / tf32 / bf16 × NDHWC / NCDHW forwards (the default paths at the
# real shapes), and `meddpm convert` of the whole-head .pt. Build: the torch_full test binary and
# main's meddpm in .devbin/tf39 (carry .devbin/tf39.tar.xz). Last run whole: 2026-11-30.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
BIN_DIR=.devbin/tf39 source scripts/gpu/bins.sh
export MEDDPM_CACHE_DIR=/tmp/cache-tf39 CUDA_MODULE_LOADING=EAGER
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/summary.txt"
TEST_BIN="$BIN/torch_full" BIN="$BIN/meddpm" RES="$OUT" timeout 420 bash scripts/gpu/torch_full.sh > "$OUT/run.log" 2>&1
echo "rc=$?" >> "$OUT/summary.txt"
grep -E "rel L2|convert:|torch_full: exit|test result|panicked" "$OUT/run.log" | sed -E 's/ \(CUDA NVIDIA.*layout [A-Za-z]+\)//' >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
