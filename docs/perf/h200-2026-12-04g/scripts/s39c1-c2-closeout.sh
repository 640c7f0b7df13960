# Prepared for the next session (not run): what issue 12's "done when" still needs on the GPU, for
# main's build (PACK=1 bash scripts/gpu/prepare.sh .devbin/all; carry .devbin/all.tar.xz).
#   PARTS=a (one call, ~8-9 min): the check (parity 23, parity_bf16 22, golden 3; ~3 min with a
#     cold NVRTC cache), then BraTS bf16 NDHWC beside PyTorch's bf16 + torch.compile row in the
#     same call (meddpm, PyTorch ~250 s, meddpm again).
#   PARTS=b (one call, ~6 min): whole-head bf16 NDHWC beside PyTorch's bf16 + torch.compile row
#     (`bench --torch --torch-compile`), then eval-configs with a bf16-trained model (scripts/gpu/evalcfg.sh).
# Then issue 12 resolves with docs/analysis/h200-brats-bf16/README.md as its miss report, if BraTS
# stays short of 2x in that same call.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
BIN_DIR=.devbin/${BINNAME:-all} source scripts/gpu/bins.sh
source scripts/gpu/libs.sh  # SP, LD_LIBRARY_PATH
export MEDDPM_CACHE_DIR=/tmp/cache-all
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader >> "$OUT/summary.txt"
step() { local what=$1; shift; local t0=$(date +%s); "$@" > "$L/$what.log" 2>&1; echo "[$what rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"; }
case ${PARTS:-a} in
  a)
    for t in parity parity_bf16 golden; do
      step "$t" env CUDA_MODULE_LOADING=EAGER timeout 300 "$BIN/$t" --test-threads=1
      grep -E "^test result|panicked|FAILED" "$L/$t.log" | head -5 >> "$OUT/summary.txt"
    done
    for r in 1 torch 2; do
      if [ $r = torch ]; then
        step torch-brats timeout 400 python3 tools/reference/bench_torch.py --preset brats --precision bf16 \
          --layout ncdhw --iters 7 --warmup 2 --compile
        tail -3 "$L/torch-brats.log" >> "$OUT/summary.txt"
      else
        step "brats-$r" timeout 200 "$BIN/meddpm" bench --device cuda --preset brats --precision bf16 --layout ndhwc \
          --iters 7 --json "$L/brats-$r.json"
        grep -E "^bench: bf16|^power.*train" "$L/brats-$r.log" >> "$OUT/summary.txt"
      fi
    done ;;
  b)
    step wholehead timeout 420 "$BIN/meddpm" bench --device cuda --preset whole-head --precision bf16 \
      --layout ndhwc --json "$L/wholehead.json" --torch --torch-compile
    grep -E "^bench|^power" "$L/wholehead.log" | head -12 >> "$OUT/summary.txt"
    step evalcfg env BIN="$BIN/meddpm" RES="$L/evalcfg" TRAIN_ARGS="--precision bf16" bash scripts/gpu/evalcfg.sh
    grep -iE "verdict|within|outside" "$L/evalcfg/eval_configs.md" | head -8 >> "$OUT/summary.txt" ;;
esac
tar -C /tmp -czf "$OUT/logs.tar.gz" logs
cat "$OUT/summary.txt"
