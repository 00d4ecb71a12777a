# virtengine-hpc: the two commands of the README, and the dev services.
.PHONY: demo test down venv lint bench record-histories

demo: ## set up, start Temporal dev server + worker + poller, run the sample jobs, print the summary
	scripts/setup-venv.sh test
	temporal-dev/temporal-up.sh
	.venv/bin/virtengine-hpc dev demo

test: ## set up everything and run the whole suite (what .ci/run runs)
	scripts/run-tests.sh

down: ## stop the demo worker, the Temporal dev server and the SLURM cluster if running
	-.venv/bin/virtengine-hpc dev stop-worker
	temporal-dev/temporal-down.sh
	-[ "$$(id -u)" != 0 ] || temporal-dev/slurm-down.sh

venv:
	scripts/setup-venv.sh test

lint: ## ruff (lint, format), mypy, and the layer contract ([tool.importlinter] in pyproject.toml, docs/architecture.md)
	.venv/bin/ruff check . && .venv/bin/ruff format --check . \
		&& .venv/bin/mypy virtengine_hpc workflows activities workers $(wildcard cli node_agent) \
		&& .venv/bin/lint-imports --no-logo

bench:
	.venv/bin/python benchmarks/pipeline.py

record-histories: ## record the replay corpus of release RELEASE (x.y.z) into tests/histories/vRELEASE (refuses an existing one)
	@test -n "$(RELEASE)" || { echo "usage: make record-histories RELEASE=0.3.0" >&2; exit 2; }
	.venv/bin/python -m tests.record_histories --release "$(RELEASE)"
