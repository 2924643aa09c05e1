# The two commands of the README: `make demo` (SNIP training of the demo model) and `make test`.
# Both set up .venv on first use (scripts/setup.sh).
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup test demo

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: $(VENV)/.installed

# The SmolLM2 and Gemma 3 tests skip where their packages are not installed, except here: setup installed them.
test: setup
	LIGHTNING_SNIP_REQUIRE_PACKAGED_MODELS=1 $(PY) -m pytest -q tests

demo: setup
	$(PY) -m lightning_snip.train $(ARGS)
