# Sourced by the study scripts (run from the repository root): one resumable training run.
#   train_run OUT FINAL_STEP NICENESS CORE_TRAIN_ARGS...
# Skips OUT when its checkpoint of FINAL_STEP exists, resumes OUT from its newest checkpoint when it has one,
# and writes the wall clock to OUT.time and the log to OUT.log. One torch thread: the scripts run two at a time.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
train_run() {
  local out=$1 steps=$2 niceness=$3; shift 3
  if [ -d "$out/checkpoints/step_$(printf %06d "$steps")" ]; then return; fi
  local resume=(); [ -d "$out/checkpoints" ] && resume=(--resume)
  /usr/bin/time -f "%e s wall" -o "$out.time" nice -n "$niceness" .venv/bin/python -m core.train "$@" \
    --out "$out" "${resume[@]}" --quiet > "$out.log" 2>&1
}
