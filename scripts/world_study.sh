#!/bin/bash
# A seed study of presets that outlives the session it runs in.
#   scripts/world_study.sh ARCHIVE "SEEDS" PRESET...
#   e.g. scripts/world_study.sh docs/study-object/runs "0 1 2 3" object-marble object-weighted-sum
# Trains every PRESET x SEED into runs/study/PRESET-sSEED, two runs at a time with one torch thread each; evaluates
# each run as soon as it finishes, on held-out prompts (EVAL_ARGS, default "--prompts-per-source 48 --seeds 12"),
# and keeps what a study needs of it in ARCHIVE/PRESET-sSEED: config.json, events.jsonl.gz, eval_test.json and .md
# (run folders, checkpoints included, do not outlive a session; commit the archive). A run whose archive holds its
# evaluation is skipped and a started run resumes, so the same command continues the study in the next session.
# Then score the study from the archive (core.evaluate reuses each stored evaluation; same EVAL_ARGS):
#   .venv/bin/python -m core.evaluate --study ARCHIVE/*-s? --out DOCS_FOLDER --prompts-per-source 48 --seeds 12
# STEPS (default 200, the mini-world presets' budget) is the step a run ends at; RUNS (default runs/study) holds the
# run folders.
cd "$(dirname "$0")/.."
source scripts/train_run.sh
if [ $# -lt 3 ]; then echo "usage: scripts/world_study.sh ARCHIVE \"SEEDS\" PRESET..." >&2; exit 2; fi
archive=$1 seeds=$2; shift 2
for s in $seeds; do require_whole SEED "$s" 0; done
[ -n "${seeds// /}" ] || { echo "SEEDS='$seeds': name at least one seed" >&2; exit 2; }
known=$(.venv/bin/python -c 'from core.presets import PRESETS; print(" ".join(PRESETS))') || exit 1
for p in "$@"; do
  [[ " $known " == *" $p "* ]] || { echo "PRESET=$p: unknown; valid choices: $known" >&2; exit 2; }
done
steps=${STEPS:-200}
require_whole STEPS "$steps" 1
runs=${RUNS:-runs/study}
read -r -a eval_args <<< "${EVAL_ARGS:---prompts-per-source 48 --seeds 12}"
one() {  # preset seed
  local name=$1-s$2 run=$runs/$1-s$2
  [ -f "$archive/$name/eval_test.json" ] && return 0
  train_run "$run" "$steps" 10 --preset "$1" --set seed="$2" --set steps="$steps" || return 1
  if ! .venv/bin/python -m core.evaluate --run "$run" "${eval_args[@]}" --threads 1 > "$run.eval.log" 2>&1; then
    echo "$run: evaluation failed: $(tail -n 1 "$run.eval.log")" >&2
    return 1
  fi
  mkdir -p "$archive/$name" && cp "$run"/{config.json,eval_test.json,eval_test.md} "$archive/$name/" &&
    gzip -nc "$run/events.jsonl" > "$archive/$name/events.jsonl.gz"
}
mkdir -p "$runs" "$archive"
jobs=()
for s in $seeds; do for p in "$@"; do jobs+=("$p $s"); done; done
in_pairs one "${jobs[@]}"
