# `make demo`: generate a criteo-profile dataset (once) and train one epoch on it.
# `make job`: the same run as a job: two reader services and the trainer, supervised.
# `make test`: the test suite (`make test-slow`: the slow end-to-end runs, which CI runs too).
# All set up .venv themselves.
VENV := .venv/bin
DEMO_DATA := data/criteo-250k

.PHONY: setup data demo job test test-slow bench

setup:
	@bash scripts/setup.sh

data: setup
	@test -f $(DEMO_DATA)/dataset.json || $(VENV)/neorec data synth --profile criteo --rows 250000 --out $(DEMO_DATA)

demo: data
	$(VENV)/neorec train configs/demo.toml --overwrite

job: data
	$(VENV)/neorec launch configs/job.toml --overwrite

test: setup
	$(VENV)/python -m pytest -q

test-slow: setup
	$(VENV)/python -m pytest -q -m slow

bench: setup
	$(VENV)/neorec bench train --json bench-train.json
	$(VENV)/neorec bench tbe --json bench-tbe.json
