# The two commands of the README: `make run` and `make test`. Both (re)create .venv when
# requirements.txt is newer than it, so a fresh clone needs nothing but Python 3.11 and make.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export GRADIO_ANALYTICS_ENABLED := False
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.PHONY: setup run train browser test test-fast bench gpu-check clean

setup: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip check
	@touch $(STAMP)

# The web app on http://127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT respected); it starts the
# job worker, which keeps running queued jobs when the page is closed.
run: $(STAMP)
	$(BIN)/python -m app

# Headless: the default MARBLE run on the pretrained mini-world model (~9 min on 2 cores, measured 8 min 51 s), in a
# new folder each time (core.train refuses to start a second run in a folder that holds one).
train: $(STAMP)
	$(BIN)/python -m core.train --preset mini-marble --out runs/mini-marble-$$(date +%Y%m%d-%H%M%S)

# Browser tests drive Debian's Chromium through Playwright (never `playwright install`: no downloads).
browser:
	@test -x /usr/bin/chromium || { if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: /usr/bin/chromium is missing (sudo apt-get install chromium); browser tests will be skipped"; fi; }

# The optional experiment trackers (TrainConfig.report_to) for their offline tests; `make run` stays without them.
$(VENV)/.installed-trackers: requirements-trackers.txt $(STAMP)
	$(BIN)/python -m pip install --quiet -r requirements-trackers.txt
	$(BIN)/python -m pip check
	@touch $@

test: $(STAMP) $(VENV)/.installed-trackers browser
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# One CUDA GPU, under 10 minutes on an H200: time per step and peak memory of MARBLE (N=10), marble_full and
# weighted sum on SD3.5 Medium's transformer with the paper's LoRA; prints and writes gpu_check.json.
# `python scripts/gpu_check.py --tiny` runs the same code path on the CPU (tests/test_sd35_path.py does).
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) scripts/gpu_check.py --out gpu_check.json

clean:
	rm -rf $(VENV) .pytest_cache
