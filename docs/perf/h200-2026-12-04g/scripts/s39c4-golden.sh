# Session 39, call 4: the new golden tests in every precision (TF32 and bf16 against the PyTorch
# float64 golden files, both layouts), printed in full, then the parity suites whose helper moved
# (rel_l2 into meddpm::testing). Build: PACK=1 bash scripts/gpu/prepare.sh .devbin/g39; carry
# .devbin/g39.tar.xz.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
BIN_DIR=.devbin/${BINNAME:-g39} source scripts/gpu/bins.sh
source scripts/gpu/libs.sh
export MEDDPM_CACHE_DIR=/tmp/cache-g39 CUDA_MODULE_LOADING=EAGER
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S"
step() { local what=$1; shift; local t0=$(date +%s); "$@" > "$L/$what.log" 2>&1; echo "[$what rc=$? $(( $(date +%s) - t0 )) s]" >> "$S"; }
step golden timeout 200 "$BIN/golden" --test-threads=1 --nocapture
grep -E "rel L2 median|loss .*(OK|NOT)|^test |test result|panicked" "$L/golden.log" >> "$S"
for t in parity_bf16 parity; do
  step "$t" timeout 240 "$BIN/$t" --test-threads=1
  grep -E "^test result|panicked|FAILED" "$L/$t.log" | head -5 >> "$S"
done
tar -C /tmp -czf "$OUT/logs.tar.gz" logs
cat "$S"
