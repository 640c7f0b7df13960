#!/usr/bin/env bash
# evalcfg.sh: issue 6's GPU report — train a demo-size model on the H200, then sample it under
# every precision/layout (`meddpm eval-configs`: fp32/ncdhw baseline, tf32/ncdhw, fp32/ndhwc,
# tf32/ndhwc, bf16/ncdhw, bf16/ndhwc; same masks, same seeds) and write the verdict table.
#
# Run by the integration script on the GPU machine with
#   BIN  the release `meddpm` binary (built on the CPU machine)
#   RES  a results folder to write into (created)
# It writes (5 files): $RES/eval_configs.md, eval_configs.json, panel_pair0.png, panel_pair1.png
# and evalcfg.log (training + eval output). The checkpoint goes to a scratch folder, not $RES.
#
# Time: training is capped by a wall-clock limit (TRAIN_SECONDS, default 60 s) as well as by a
# step count (STEPS, default 3000): `train` saves a checkpoint every CKPT_EVERY steps, so when the
# limit stops it, the last checkpoint (at most CKPT_EVERY steps back) is evaluated and the report
# states its step. The eval is capped at EVAL_SECONDS (default 80 s). Total ≤ ~2.5 min.
#
# Model: the 32³ demo volumes with MODEL_CHANNELS (default 32) base channels, channel_mult
# [1,2,2,4], attention at 4³ (the demo preset has 8 channels), lr 2e-4, EMA decay 0.995 every
# step from step 500. Other knobs (for testing the logic on a CPU: DEVICE=cpu STEPS=2 SEEDS=2
# TIMESTEPS=3 MODEL_CHANNELS=8): DEVICE (cuda), SEEDS (3), TIMESTEPS (the training's 250),
# CONFIGS (all four), EVALCFG_CMD (eval-configs: the subcommand as wired in main.rs), TRAIN_ARGS
# (extra `train` flags, e.g. "--precision bf16" to check a training-side change).
set -uo pipefail
: "${BIN:?set BIN to the meddpm binary}" "${RES:?set RES to a results folder}"
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-3000}
CKPT_EVERY=${CKPT_EVERY:-200}
TRAIN_SECONDS=${TRAIN_SECONDS:-60}
EVAL_SECONDS=${EVAL_SECONDS:-150}
SEEDS=${SEEDS:-3}
MODEL_CHANNELS=${MODEL_CHANNELS:-32}
CONFIGS=${CONFIGS:-fp32/ncdhw,tf32/ncdhw,fp32/ndhwc,tf32/ndhwc,bf16/ncdhw,bf16/ndhwc}
EVALCFG_CMD=${EVALCFG_CMD:-eval-configs}
mkdir -p "$RES"
LOG="$RES/evalcfg.log"
: >"$LOG"
WORK=$(mktemp -d /tmp/evalcfg.XXXXXX)
say() { echo "$*" | tee -a "$LOG"; }

# cuDNN trap (../shared/docs/gpu-machine.md): make `libcudnn.so` resolve to PyTorch's 9.19, unless
# the caller already put a libcudnn.so first in LD_LIBRARY_PATH.
if [ "$DEVICE" != cpu ]; then
  SP=$(python3 -c "import site; print(site.getsitepackages()[0])" 2>/dev/null || true)
  if [ -n "$SP" ] && [ -e "$SP/nvidia/cudnn/lib/libcudnn.so.9" ]; then
    first=$(echo "${LD_LIBRARY_PATH:-}" | cut -d: -f1)
    if [ -z "$first" ] || [ ! -e "$first/libcudnn.so" ]; then
      mkdir -p "$WORK/lib"
      ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$WORK/lib/libcudnn.so"
      export LD_LIBRARY_PATH="$WORK/lib:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    fi
  fi
  export MEDDPM_CACHE_DIR=${MEDDPM_CACHE_DIR:-/tmp/meddpm-cache}
fi

groups=8
[ $((MODEL_CHANNELS % 8)) -eq 0 ] || groups=4
cat >"$WORK/run.toml" <<TOML
[unet]
depth = 32
size = 32
in_channels = 3
out_channels = 1
model_channels = $MODEL_CHANNELS
channel_mult = [1, 2, 2, 4]
num_res_blocks = 1
attention_ds = [4]
num_heads = 1
groups = $groups

[train]
lr = 2e-4
ema_decay = 0.995
ema_every = 1
ema_start = 500

[run]
checkpoint_every = $CKPT_EVERY
sample_at_end = false
TOML
say "== evalcfg: $(date -u +%FT%TZ), device $DEVICE, model 32³ × $MODEL_CHANNELS ch, ≤ $STEPS steps / ${TRAIN_SECONDS} s"
sed 's/^/   /' "$WORK/run.toml" >>"$LOG"

t0=$(date +%s)
timeout -s INT "$TRAIN_SECONDS" "$BIN" train --device "$DEVICE" --config "$WORK/run.toml" --steps "$STEPS" \
  --out "$WORK/train" ${TRAIN_ARGS:-} >>"$LOG" 2>&1
rc=$?
t1=$(date +%s)
CK="$WORK/train/checkpoint.safetensors"
if [ $rc -eq 124 ]; then
  say "training: stopped by the ${TRAIN_SECONDS} s limit after $((t1 - t0)) s; evaluating the last checkpoint"
elif [ $rc -ne 0 ]; then
  say "training FAILED (exit $rc) after $((t1 - t0)) s; last lines:"; tail -5 "$LOG"
else
  say "training: done in $((t1 - t0)) s"
fi
grep -E "^(model:|training: steps|done:)" "$LOG" | sed 's/^/   /'
if [ ! -s "$CK" ]; then
  say "no checkpoint in $WORK/train (training too slow for one checkpoint every $CKPT_EVERY steps?)"
  rm -rf "$WORK"; exit 1
fi

extra=()
[ -n "${TIMESTEPS:-}" ] && extra+=(--timesteps "$TIMESTEPS")
timeout -s INT "$EVAL_SECONDS" "$BIN" "$EVALCFG_CMD" --checkpoint "$CK" --device "$DEVICE" --configs "$CONFIGS" \
  --seeds "$SEEDS" --out "$RES" "${extra[@]}" >>"$LOG" 2>&1
rc=$?
t2=$(date +%s)
if [ $rc -ne 0 ]; then
  say "eval-configs FAILED or timed out (exit $rc) after $((t2 - t1)) s; last lines:"; tail -8 "$LOG"
  rm -rf "$WORK"; exit 1
fi
say "eval-configs: $((t2 - t1)) s; total $((t2 - t0)) s; $(grep -o "(step [0-9]*" "$RES/eval_configs.md" | head -1 | tr -d "(") of training evaluated"
# Short table last: the verdict rows.
grep -E "^\| (cpu|fp32|tf32|bf16).*(baseline|spread|skipped|K < 2)" "$RES/eval_configs.md"
rm -rf "$WORK"
