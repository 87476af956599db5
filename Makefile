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

.PHONY: setup run train test test-fast bench clean

setup: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip check
	@touch $(STAMP)

# Until the web app lands: a short headless MARBLE run on the built-in default model.
run: $(STAMP)
	$(BIN)/python -m core.train --preset tiny --out runs/quickstart --steps 20

train: run

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
