# The two commands of the README. Both set up ./.venv first (idempotent; see scripts/setup.sh).
.PHONY: setup train test
PY := .venv/bin/python

setup:
	bash scripts/setup.sh

# The main job on its embedded defaults.
train: setup
	.venv/bin/feather-train

test: setup
	$(PY) -m pytest -q
