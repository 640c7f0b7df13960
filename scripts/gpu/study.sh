#!/usr/bin/env bash
# study.sh PART...: the GPU runs behind the bundled demo model (issue 16), the sampler study
# (issue 13) and the BraTS numbers (issue 11), run on the GPU machine from the repository root
# after scripts/gpu/run.sh has set up the libraries (it sources nothing: call it through run.sh's
# environment, e.g. `bash scripts/gpu/run.sh study`, which runs `study.sh $STUDY`).
# Parts:
#   demo      train the demo preset (32³, 8 base channels) on the GPU for DEMO_SECONDS (default 100)
#             in bf16 (SIGINT at the limit: the run saves its checkpoint and stops), then export its
#             EMA weights as testdata/demo/model.safetensors ($OUT/demo/model.safetensors)
#   samplers  the sampler study on that model: every sampler × {10, 20, 50, 100, 250} steps, 4 seeds,
#             mask and real volume of demo pair 0 (scripts/gpu/samplers.sh) → $OUT/samplers/
#   wholehead 20-step volumes of the whole-head model (initial weights: the time does not depend on
#             them) with iPNDM and DPM-Solver++, batch 1 and 4, bf16 and TF32 → $OUT/wholehead/
#   brats     meddpm bench on the BraTS preset, bf16 and TF32, NDHWC → $OUT/brats/
# Needs BIN (the meddpm binary) and OUT.
set -uo pipefail
: "${BIN:?set BIN to the meddpm binary}" "${OUT:?set OUT}"
W=${WORK:-/tmp/meddpm-study}
mkdir -p "$W" "$OUT"
for part in "$@"; do
  R="$OUT/$part"
  mkdir -p "$R"
  t0=$(date +%s)
  case $part in
    demo)
      timeout -s INT "${DEMO_SECONDS:-100}" "$BIN" train --device cuda --precision bf16 --steps "${DEMO_STEPS:-100000}" \
        --checkpoint-every 1000 --out "$W/demo" >"$R/train.log" 2>&1
      echo "demo training: exit $? after $(( $(date +%s) - t0 )) s"
      grep -E "^(model|training|done|resume|stopped|data)" "$R/train.log" | head
      tail -3 "$W/demo/loss.csv"
      "$BIN" convert "$W/demo/checkpoint.safetensors" "$R/model.safetensors" 2>&1 | tail -1
      "$BIN" sample --checkpoint "$R/model.safetensors" --device cuda --out "$R/sample" 2>&1 | tail -2
      cp "$W/demo/loss.csv" "$W/demo/loss.svg" "$R/" 2>/dev/null
      ls -la "$R" ;;
    samplers)
      CK="$OUT/demo/model.safetensors" MASK=.devbin/study/mask_0.nii.gz REAL=.devbin/study/real_0.nii.gz \
        OUT="$R" WORK="$W/samplers" SEEDS=${SEEDS:-4} BATCH=${BATCH:-2} bash scripts/gpu/samplers.sh >"$R/study.log" 2>&1
      echo "sampler study: exit $? after $(( $(date +%s) - t0 )) s"
      tail -25 "$R/study.log" ;;
    wholehead)
      "$BIN" train --device cuda --preset whole-head --steps 0 --no-sample --out "$W/wh" >"$R/init.log" 2>&1
      for p in bf16 tf32; do
        for s in ipndm dpm-solver++; do
          for b in 1 4; do
            echo "== $p $s 20 steps batch $b"
            "$BIN" sample --checkpoint "$W/wh/checkpoint.safetensors" --device cuda --precision "$p" --sampler "$s" \
              --steps 20 --num-samples 8 --batch "$b" --out "$W/wh_${p}_${s}_$b/s" >"$R/${p}_${s}_$b.log" 2>&1
            grep -E "batch of|error" "$R/${p}_${s}_$b.log" | tail -3
            cp "$W/wh_${p}_${s}_$b/s_timing.json" "$R/${p}_${s}_${b}_timing.json" 2>/dev/null
          done
        done
      done ;;
    brats)
      "$BIN" bench --device cuda --preset brats --precision bf16,tf32 --layout ndhwc --iters 3 --warmup 1 \
        --json "$R/bench.json" >"$R/bench.log" 2>&1
      echo "brats bench: exit $?"; tail -6 "$R/bench.log" ;;
    *) echo "unknown study part $part" ;;
  esac
  echo "== study $part: $(( $(date +%s) - t0 )) s"
done
