#!/bin/bash
# Issue 16's ceiling table: each training reward of the quality world trained alone on its share of a step's
# images (a specialist: its own source's 4 prompts x 4 images = 16 of the 48 a multi-reward step has), 200
# steps, the presets' other settings. Resumable: finished runs are skipped, started ones resume.
#   scripts/ceiling_at_share.sh SEED REWARD...        e.g. scripts/ceiling_at_share.sh 0 count_accuracy single_object
# SHARE_PROMPTS=6 gives a specialist 6 prompts x 4 images = 24 images a step (its share when a step's 12 prompts
# come from two sources instead of three); those runs go to runs/ceiling-share6/. EXTRA adds settings and TAG
# names their folder, e.g. EXTRA="--set optim.lr=0.00025" TAG=-lr2.5e-4 -> runs/ceiling-share6-lr2.5e-4/.
# STEPS=400 trains 400 steps instead of 200 (name the folder with TAG).
# SOURCES='["world-single","world-size"]' sets every run's prompt sources (a JSON list), e.g. a general reward on
# another world's sources, or a specialist on one of its sources' other halves.
cd "$(dirname "$0")/.."
source scripts/train_run.sh
if [ $# -lt 2 ]; then echo "usage: scripts/ceiling_at_share.sh SEED REWARD..." >&2; exit 2; fi
seed=$1; shift
require_whole SEED "$seed" 0
prompts=${SHARE_PROMPTS:-4}
require_whole SHARE_PROMPTS "$prompts" 1
root=runs/ceiling-share; [ "$prompts" != 4 ] && root=runs/ceiling-share$prompts
root=$root${TAG:-}
read -r -a extra <<< "${EXTRA:-}"
steps=${STEPS:-200}
require_whole STEPS "$steps" 1
declare -A SOURCE=([single_object]=world-general [color_fidelity]=world-color [count_accuracy]=world-count
                   [spatial_relation]=world-position [object_size]=world-size)
one() {  # reward
  src=${SOURCE[$1]}
  if [ -n "$src" ]; then  # a specialist: its own source, 4 prompts x 4 images
    share=(--set "prompts.sources=${SOURCES:-[\"$src\"]}" --set sampling.prompts_per_step=$prompts
           --set nft.micro_batch_size=$((prompts * 4)))
  else  # a general reward is valid on every image of the three sources
    share=(--set "prompts.sources=${SOURCES:-[\"world-general\",\"world-color\",\"world-count\"]}")
  fi
  train_run $root/$1-s$seed $steps 10 --preset mini-marble --set seed=$seed --set balance.strategy=single \
    --set balance.single_reward=$1 --set "rewards=[\"$1\"]" --set steps=$steps "${share[@]}" "${extra[@]}"
}
mkdir -p $root
pids=()
for r in "$@"; do one $r & pids+=($!); done
wait_all "${pids[@]}"
