# `make demo`: generate a criteo-profile dataset (once) and train one epoch on it.
# `make job`: the same run as a job: two reader services and the trainer, supervised.
# `make two-nodes`: two trainer nodes on this host beside one node of as many ranks (times, same summary).
# `make elastic`: two nodes under --max-restarts 1; a rank is SIGKILLed and the run resumes on its own.
# `make test`: the test suite (`make test-slow`: the slow end-to-end runs, which CI runs too).
# All set up .venv themselves.
VENV := .venv/bin
DEMO_DATA := data/criteo-250k

.PHONY: setup data demo job two-nodes elastic test test-slow bench

setup:
	@bash scripts/setup.sh

data: setup
	@test -f $(DEMO_DATA)/dataset.json || $(VENV)/neorec data synth --profile criteo --rows 250000 --out $(DEMO_DATA)

demo: data
	$(VENV)/neorec train configs/demo.toml --overwrite

job: data
	$(VENV)/neorec launch configs/job.toml --overwrite

two-nodes: data
	@bash scripts/two_nodes.sh

elastic: data
	@bash scripts/elastic.sh

test: setup
	$(VENV)/python -m pytest -q

test-slow: setup
	$(VENV)/python -m pytest -q -m slow

bench: setup
	$(VENV)/neorec bench train --json bench-train.json
	$(VENV)/neorec bench tbe --json bench-tbe.json
