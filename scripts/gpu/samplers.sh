#!/usr/bin/env bash
# samplers.sh: issue 13's sampler study — the same mask and seeds sampled with every sampler at
# every step count, scored with `meddpm eval`, summarised as a table and an SVG of quality
# against wall time per volume (`meddpm eval-samplers`, code in crates/meddpm/src/eval/samplers.rs).
#
# Run on the GPU machine from the repository root with
#   BIN   the release `meddpm` binary (scripts/gpu/prepare.sh builds it: .devbin/all/meddpm)
#   CK    a trained checkpoint (meddpm, safetensors or reference .pt)
#   MASK  the conditioning mask (NIfTI, labels 0/1/2, on the model's grid)
#   REAL  the real image of that mask on the same grid, scaled to the model's [-1, 1]
# Optional: OUT (docs/eval/samplers), WORK (a scratch folder, kept: volumes are large),
#   SAMPLERS ("ddpm ddim dpm-solver++ ipndm"), STEPS ("10 20 50 100 250"), SEEDS (4: seeds
#   0..SEEDS-1), BATCH (1), ETA (DDIM's η, 0), TIMESTEPS (250), DEVICE (cuda),
#   SAMPLE_ARGS (more `meddpm sample` options, e.g. "--precision tf32 --layout ndhwc").
#
# Per run WORK/runs/<sampler>_<steps>/: gen/ (volumes, PNGs, s_timing.json), timing.json,
# quality/eval.json (against REAL, inside MASK), agreement/eval.json (against DDPM-250's volume of
# the same seed: run ddpm 250 is the reference, so keep it in SAMPLERS/STEPS). Runs whose
# timing.json exists are skipped, so the study can be split over several calls (each call of the
# device tool is limited to 10 minutes). OUT gets samplers.md, samplers.csv, samplers.svg and the
# small per-run JSON files (runs/<sampler>_<steps>/{timing,quality,agreement}.json); no volumes.
#
# Wall time per volume: `meddpm sample` times each batch from the first noise draw to the volumes
# on the host; the table uses the mean over the batches after the first (start-up excluded), so
# SEEDS/BATCH should be ≥ 2. Cost at 128³ on the H200 (TF32, ~49 ms per forward): Σ steps = 430
# network evaluations per sampler and seed, ≈ 1700 × SEEDS forwards in all (≈ 6 min for 4 seeds),
# plus two evals per run on the CPU.
set -euo pipefail
: "${BIN:?set BIN to the meddpm binary}" "${CK:?set CK to a checkpoint}" "${MASK:?set MASK}" "${REAL:?set REAL}"
OUT=${OUT:-docs/eval/samplers}
WORK=${WORK:-/tmp/meddpm-samplers}
SAMPLERS=${SAMPLERS:-ddpm ddim dpm-solver++ ipndm}
STEPS=${STEPS:-10 20 50 100 250}
SEEDS=${SEEDS:-4}
BATCH=${BATCH:-1}
ETA=${ETA:-0}
TIMESTEPS=${TIMESTEPS:-250}
DEVICE=${DEVICE:-cuda}
read -r -a extra <<<"${SAMPLE_ARGS:-}"
mkdir -p "$WORK/runs" "$OUT/runs"
echo "== samplers: $(date -u +%FT%TZ) checkpoint $CK, mask $MASK, real $REAL, $SEEDS seed(s), batch $BATCH"

for s in $SAMPLERS; do
  for n in $STEPS; do
    run="$WORK/runs/${s}_${n}"
    if [ -s "$run/timing.json" ]; then echo "-- $s $n: done before"; continue; fi
    rm -rf "$run" && mkdir -p "$run/gen"
    eta=()
    [ "$s" = ddim ] && eta=(--eta "$ETA")
    echo "-- $s $n"
    if ! "$BIN" sample --checkpoint "$CK" --device "$DEVICE" --timesteps "$TIMESTEPS" --mask "$MASK" \
      --sampler "$s" --steps "$n" "${eta[@]}" --num-samples "$SEEDS" --seed 0 --batch "$BATCH" \
      --out "$run/gen/s" "${extra[@]}" >"$run/sample.log" 2>&1; then
      tail -5 "$run/sample.log"; exit 1
    fi
    grep -E "^(meddpm sample|[0-9]+ volume)" "$run/sample.log" || true
    # a single seed is written as s.nii.gz: name it like the others so the pairing by name holds
    if [ -f "$run/gen/s.nii.gz" ]; then mv "$run/gen/s.nii.gz" "$run/gen/s_0.nii.gz"; fi
    "$BIN" eval --real "$REAL" --generated "$run/gen" --mask "$MASK" --out "$run/quality" --no-panel >/dev/null
    cp "$run/gen/s_timing.json" "$run/timing.json"
  done
done

ref="$WORK/runs/ddpm_${TIMESTEPS}/gen"
if [ -d "$ref" ]; then
  for run in "$WORK"/runs/*/; do
    if [ -s "$run/agreement/eval.json" ]; then continue; fi
    "$BIN" eval --real "$ref" --generated "$run/gen" --mask "$MASK" --out "$run/agreement" --no-panel >/dev/null
  done
else
  echo "no ddpm ${TIMESTEPS}-step run: no agreement column"
fi

"$BIN" eval-samplers --runs "$WORK/runs" --out "$OUT"
for run in "$WORK"/runs/*/; do
  name=$(basename "$run")
  mkdir -p "$OUT/runs/$name"
  cp "$run/timing.json" "$OUT/runs/$name/timing.json"
  cp "$run/quality/eval.json" "$OUT/runs/$name/quality.json"
  if [ -f "$run/agreement/eval.json" ]; then cp "$run/agreement/eval.json" "$OUT/runs/$name/agreement.json"; fi
done
echo "== samplers: wrote $OUT"
