#!/bin/bash
# The amortized-combination ablation of issue 15 (docs/faithfulness.md). Resumable: finished runs are skipped,
# started ones resume from their newest checkpoint.
# 8 runs, 2 at a time (a failing one is named on stderr, exit 1): mini-marble with balance.amortized_combination masked vs authors, seeds 0-3.
cd "$(dirname "$0")/.."
source scripts/train_run.sh
one() {  # form seed
  train_run runs/ablation-amortized/$1-s$2 200 15 --preset mini-marble --set seed=$2 \
    --set balance.amortized_combination=$1 --set balance.gradients=per_reward
}
mkdir -p runs/ablation-amortized
jobs=()
for s in ${SEEDS:-0 1 2 3}; do require_whole SEEDS "$s" 0; jobs+=("masked $s" "authors $s"); done
in_pairs one "${jobs[@]}"
