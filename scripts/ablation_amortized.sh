#!/bin/bash
# The amortized-combination ablation of issue 15 (docs/faithfulness.md). Resumable: finished runs are skipped,
# started ones resume from their newest checkpoint.
# 8 runs, 2 at a time: mini-marble with balance.amortized_combination masked vs authors, seeds 0-3.
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
one() {  # form seed
  out=runs/ablation-amortized/$1-s$2
  if [ -d $out/checkpoints/step_000200 ]; then return; fi
  resume=""; [ -d $out/checkpoints ] && resume="--resume"
  /usr/bin/time -f "%e s wall" -o $out.time nice -n 15 .venv/bin/python -m core.train --preset mini-marble \
    --set seed=$2 --set balance.amortized_combination=$1 --set balance.gradients=per_reward \
    --out $out $resume --quiet > $out.log 2>&1
}
mkdir -p runs/ablation-amortized
for s in ${SEEDS:-0 1 2 3}; do
  one masked $s & one authors $s & wait
done
