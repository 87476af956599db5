# Sourced by the study scripts (run from the repository root): one resumable training run.
#   train_run OUT FINAL_STEP NICENESS CORE_TRAIN_ARGS...
# Skips OUT when its checkpoint of FINAL_STEP exists, resumes OUT from its newest checkpoint when it has one,
# and writes the wall clock to OUT.time and the log to OUT.log; a run that fails says so on stderr, with its log's
# last line, and returns core.train's exit status. One torch thread: the scripts run two at a time.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
train_run() {
  local out=$1 steps=$2 niceness=$3; shift 3
  if [ -d "$out/checkpoints/step_$(printf %06d "$steps")" ]; then return; fi
  local resume=(); [ -d "$out/checkpoints" ] && resume=(--resume)
  /usr/bin/time -f "%e s wall" -o "$out.time" nice -n "$niceness" .venv/bin/python -m core.train "$@" \
    --out "$out" "${resume[@]}" --quiet > "$out.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || echo "$out: training failed (exit $rc): $(tail -n 1 "$out.log")" >&2
  return $rc
}
# wait_all PID...: wait for every one; fails when any failed (a bare `wait` answers 0 whatever they did).
wait_all() {
  local pid status=0
  for pid in "$@"; do wait "$pid" || status=1; done
  return $status
}
# require_whole NAME VALUE MIN: exit 2 with a message naming NAME unless VALUE is a whole number >= MIN.
require_whole() {
  if ! [[ $2 =~ ^[0-9]+$ ]] || [ "$2" -lt "$3" ]; then
    echo "$1=$2: must be a whole number >= $3" >&2
    exit 2
  fi
}
# in_pairs FN JOB...: FN with each JOB's words as arguments, two jobs at a time (the scripts' two cores); fails when
# any failed, after all have run.
in_pairs() {
  local fn=$1 i status=0 pids; shift
  local jobs=("$@")
  for ((i = 0; i < ${#jobs[@]}; i += 2)); do
    pids=()
    $fn ${jobs[i]} & pids+=($!)
    if [ -n "${jobs[i+1]:-}" ]; then $fn ${jobs[i+1]} & pids+=($!); fi
    wait_all "${pids[@]}" || status=1
  done
  return $status
}
