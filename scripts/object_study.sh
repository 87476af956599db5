#!/bin/bash
# Issue 16's study on the object world: every object-* preset x seeds through scripts/world_study.sh (two runs at a
# time, each evaluated as it finishes on the held-out prompts, 24 seeds each, and kept in docs/study-object/runs/;
# commit that folder and the same command continues the study in a later session).
#   scripts/object_study.sh "0 1 2 3" [preset ...]     (default presets: all five object-*)
# then score it from the archive:
#   .venv/bin/python -m core.evaluate --study docs/study-object/runs/object-*-s? --out docs/study-object \
#       --prompts-per-source 48 --seeds 24 --threads 2
cd "$(dirname "$0")/.."
seeds=${1:-"0 1 2 3"}; shift
presets=("$@"); [ ${#presets[@]} -eq 0 ] && presets=(object-marble object-weighted-sum object-equal object-sequential
                                                       object-marble-full)
EVAL_ARGS=${EVAL_ARGS:-"--prompts-per-source 48 --seeds 24"} exec scripts/world_study.sh docs/study-object/runs \
  "$seeds" "${presets[@]}"
