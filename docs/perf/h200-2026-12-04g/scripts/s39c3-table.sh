# Session 39, call 3: the README's whole-head table from one call, main's build (carry
# .devbin/m38.tar.xz: crates/ identical to HEAD). meddpm's four precision × layout rows with a real
# 250-step volume each, PyTorch's best (bf16 autocast + torch.compile, NCDHW) and default (TF32,
# NCDHW) rows, meddpm's bf16 NDHWC row again after them, then the whole-head bf16 NDHWC profile.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
BIN_DIR=.devbin/${BINNAME:-m38} source scripts/gpu/bins.sh
source scripts/gpu/libs.sh
export MEDDPM_CACHE_DIR=/tmp/cache-all
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader >> "$S"
step() { local what=$1; shift; local t0=$(date +%s); "$@" > "$L/$what.log" 2>&1; echo "[$what rc=$? $(( $(date +%s) - t0 )) s]" >> "$S"; }
step meddpm-4rows timeout 240 "$BIN/meddpm" bench --device cuda --preset whole-head --precision bf16,tf32 \
  --layout ndhwc,ncdhw --iters 7 --full --json "$L/meddpm-4rows.json"
grep -A6 "^device prec" "$L/meddpm-4rows.log" | grep -v "^power" >> "$S"
step torch-bf16-compile timeout 300 python3 tools/reference/bench_torch.py --preset whole-head --precision bf16 \
  --layout ncdhw --iters 7 --warmup 2 --compile
tail -1 "$L/torch-bf16-compile.log" | cut -c1-400 >> "$S"
step torch-tf32 timeout 120 python3 tools/reference/bench_torch.py --preset whole-head --precision tf32 \
  --layout ncdhw --iters 5 --warmup 2
tail -1 "$L/torch-tf32.log" | cut -c1-400 >> "$S"
step meddpm-again timeout 60 "$BIN/meddpm" bench --device cuda --preset whole-head --precision bf16 \
  --layout ndhwc --iters 7 --json "$L/meddpm-again.json"
grep -E "^bench: bf16" "$L/meddpm-again.log" >> "$S"
step prof timeout 150 "$BIN/meddpm" profile --device cuda --preset whole-head --math bf16 --layout ndhwc \
  --warmup 1 --repeats 3 --out /tmp/logs/prof
grep -E "^\| (normalization|elementwise|GPU idle)" /tmp/logs/prof/report.md | head -12 >> "$S"
tar -C /tmp -czf "$OUT/logs.tar.gz" logs
cat "$S"
