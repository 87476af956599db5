#!/bin/bash
# Issue 16's study on the quality world: every quality-* preset x seeds, two runs at a time, one torch thread
# each. Resumable: finished runs are skipped, started ones resume from their newest checkpoint, so a study
# longer than one session is continued by running the same command again.
#   scripts/quality_study.sh "0 1 2 3" [preset ...]     (default presets: all five quality-*)
# then score it on held-out prompts:
#   .venv/bin/python -m core.evaluate --study runs/quality-study/quality-*-s? --out docs/study-quality \
#       --prompts-per-source 48 --seeds 6 --threads 2
cd "$(dirname "$0")/.."
source scripts/train_run.sh
seeds=${1:-"0 1 2 3"}; shift
presets=("$@"); [ ${#presets[@]} -eq 0 ] && presets=(quality-marble quality-weighted-sum quality-equal quality-sequential
                                                       quality-marble-full)
one() {  # preset seed
  train_run runs/quality-study/$1-s$2 200 10 --preset $1 --set seed=$2
}
mkdir -p runs/quality-study
jobs=()
for s in $seeds; do for p in "${presets[@]}"; do jobs+=("$p $s"); done; done
for ((i = 0; i < ${#jobs[@]}; i += 2)); do
  one ${jobs[i]} & [ -n "${jobs[i+1]}" ] && one ${jobs[i+1]} &
  wait
done
