#!/bin/bash
# Issue 16's studies: a world's five presets (FAMILY-marble, -weighted-sum, -equal, -sequential, -marble-full) x seeds
# through scripts/world_study.sh: two runs at a time, each evaluated on held-out prompts as it finishes and kept in
# docs/study-FAMILY/runs/; commit that folder and the same command continues the study in a later session.
#   scripts/family_study.sh FAMILY "0 1 2 3" [preset ...]      FAMILY: object, object150 or quality
# then score it from the archive (the same evaluation settings: 24 seeds a prompt for object, 6 for quality):
#   .venv/bin/python -m core.evaluate --study docs/study-object/runs/object-*-s? --out docs/study-object \
#       --prompts-per-source 48 --seeds 24 --threads 2
cd "$(dirname "$0")/.."
family=$1
case $family in
  object) seeds_per_prompt=24 ;;   # world-single has only 4 test prompts
  object150) seeds_per_prompt=24; export STEPS=${STEPS:-150} ;;   # the family's budget (core/presets.py)
  quality) seeds_per_prompt=6 ;;
  *) echo "usage: scripts/family_study.sh FAMILY \"SEEDS\" [preset ...]; FAMILY: object, object150 or quality (got '$family')" >&2
     exit 2 ;;
esac
shift
seeds=${1:-"0 1 2 3"}; shift
presets=("$@")
[ ${#presets[@]} -eq 0 ] && presets=("$family"-{marble,weighted-sum,equal,sequential,marble-full})
EVAL_ARGS=${EVAL_ARGS:-"--prompts-per-source 48 --seeds $seeds_per_prompt"} exec scripts/world_study.sh \
  "docs/study-$family/runs" "$seeds" "${presets[@]}"
