#!/bin/bash
# Issue 16's study on the quality world: every quality-* preset x seeds through scripts/world_study.sh (two runs at a
# time, each evaluated as it finishes and kept in docs/study-quality/runs/, so the study continues in a later
# session by running the same command again).
#   scripts/quality_study.sh "0 1 2 3" [preset ...]     (default presets: all five quality-*)
# then score it from the archive:
#   .venv/bin/python -m core.evaluate --study docs/study-quality/runs/quality-*-s? --out docs/study-quality \
#       --prompts-per-source 48 --seeds 6 --threads 2
cd "$(dirname "$0")/.."
seeds=${1:-"0 1 2 3"}; shift
presets=("$@"); [ ${#presets[@]} -eq 0 ] && presets=(quality-marble quality-weighted-sum quality-equal quality-sequential
                                                       quality-marble-full)
EVAL_ARGS=${EVAL_ARGS:-"--prompts-per-source 48 --seeds 6"} exec scripts/world_study.sh docs/study-quality/runs \
  "$seeds" "${presets[@]}"
