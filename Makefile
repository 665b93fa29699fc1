# Entry points, each doing its own set-up on a fresh clone:
#   make demo       pretrain the default recipe on Tiny Shakespeare, then generate from the result
#   make test       the fast tests: everything not marked slow (the inner loop)
#   make test-all   every test, the slow ones too (whole training runs, subprocesses, the Hub mirror): CI's
# Both create .venv and install decoderlab into it (torch 2.13.0 first: see README).

VENV ?= .venv
PY := $(VENV)/bin/python
# Offline copy when it sits beside the checkout, else the Hub dataset
DATA ?= $(if $(wildcard ../shared/data/tiny_shakespeare),../shared/data/tiny_shakespeare,karpathy/tiny_shakespeare)
OUT ?= out/shakespeare_char
DEMO_ARGS ?=
PYTEST_ARGS ?=

OLAH_VENV ?= .venv-olah

.PHONY: venv olah demo test test-all lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# olah (an open-source Hub mirror) serves a test repository in tests/test_hub.py; its own venv
# keeps its dependencies apart from ours
$(OLAH_VENV)/.installed:
	python3 -m venv $(OLAH_VENV)
	$(OLAH_VENV)/bin/pip install -q olah==0.5.4
	touch $@

olah: $(OLAH_VENV)/.installed

demo: venv
	$(PY) training/pretrain.py --config training/configs/shakespeare_char.yaml \
		--dataset_name $(DATA) --output_dir $(OUT) $(DEMO_ARGS)
	$(PY) training/generate.py $(OUT) --prompt "ROMEO:" --max_new_tokens 300

# PYTEST_ARGS come last, so `make test PYTEST_ARGS="-k rope"` narrows the run and `-m slow` replaces the marker
test: venv
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: venv olah
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(OLAH_VENV) out
