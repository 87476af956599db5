#!/bin/bash
# Issue 20's mini-world study: exact MARBLE on every step (marble_full, the whole step harmonized, per-sample
# gradients) on the default preset, seeds 0-3, to set beside the amortized-MARBLE runs of the issue-15
# ablation (docs/ablation-amortized, form "masked"). Two runs at a time, one torch thread each. Resumable:
# finished runs are skipped, started ones resume from their newest checkpoint.
#   scripts/exact_study.sh            # SEEDS="2 3" picks seeds
# then score it on the ablation's held-out prompts:
#   .venv/bin/python -m core.evaluate --study runs/exact-study/full-s{0,1,2,3} --out docs/exact-study \
#       --prompts-per-source 24 --seeds 4 --threads 2 --weights raw
cd "$(dirname "$0")/.."
source scripts/train_run.sh
one() {  # seed
  train_run runs/exact-study/full-s$1 200 10 --preset mini-marble --set seed=$1 --set balance.strategy=marble_full \
    --set balance.harmonize_scope=step --set balance.gradients=per_sample
}
seeds=(${SEEDS:-0 1 2 3})
for s in "${seeds[@]}"; do require_whole SEEDS "$s" 0; done
mkdir -p runs/exact-study
in_pairs one "${seeds[@]}"
