# The README's commands. Each sets up ./.venv first (idempotent; see scripts/setup.sh).
.PHONY: setup train test test-fast lint
PY := .venv/bin/python
# Two workers for the two cores; a module's live tests and all Ray tests each stay on one worker.
XDIST := -n 2 --dist loadgroup

setup:
	bash scripts/setup.sh

# The main job on its embedded defaults.
train: setup
	.venv/bin/feather-train

# Everything: live engines and servers, Ray training, and the lint.
test: setup lint
	$(PY) -m pytest -q $(XDIST)

# No engine, no server, no Ray, nothing slow.
test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not live and not train and not slow"

lint: setup
	.venv/bin/ruff check .
