# Two commands on a fresh machine: `make run` (main job on the bundled trace) and `make test`
# (`make check`: the fast loop without Ray or slow tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run run-local baselines serve soak test check bench setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m launch.train --json runs/train.json --curve runs/train_curve.png

run-local: $(STAMP)
	$(BIN)/python -m launch.train --local --json runs/train_local.json --curve runs/train_local_curve.png

baselines: $(STAMP)
	$(BIN)/python -m launch.evaluate --policy all --plot runs/baselines.png

serve: $(STAMP)
	$(BIN)/python -m launch.serve --checkpoint runs/train/checkpoint.pt

soak: $(STAMP)
	$(BIN)/python -m launch.soak --minutes 10 --json runs/soak.json

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25

# The fast loop (no Ray cluster, nothing slow): a few minutes; `make test` stays the full suite.
check: $(STAMP)
	$(BIN)/python -m pytest -q -m "not ray and not slow"

bench: $(STAMP)
	$(BIN)/python -m launch.bench sim --json runs/bench_sim.json
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m launch.bench replay --json runs/bench_replay.json
	$(BIN)/python -m launch.bench apex --json runs/bench_apex.json --plot runs/bench_apex.png
	$(BIN)/python -m launch.bench preference --json runs/bench_preference.json
	$(BIN)/python -m launch.bench serve --json runs/bench_serve.json

clean:
	rm -rf $(VENV) build *.egg-info
