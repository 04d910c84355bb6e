# exl3tools — see README.md. `make run` sets everything up and runs the demo; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install dev run test test-gpu lint bench bench-gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is the local CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)
dev: install

run: install
	PATH="$(abspath $(BIN)):$$PATH" bash scripts/demo.sh

# TRITON_INTERPRET=1: without a GPU, tests/gpu runs our Triton kernels on the CPU interpreter.
# One BLAS/OpenMP thread per test worker: two workers on 2 cores with torch's and OpenBLAS's own
# thread pools spin against each other (tests/test_runtime_mla.py + test_paged_runner.py: 62 s -> 24 s)
TEST_THREADS := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
test: install
	$(TEST_THREADS) TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile tests

test-gpu: install
	$(BIN)/python -m pytest -q tests/gpu

lint: install
	$(BIN)/ruff check exl3tools cli kernels tests bench

bench: install
	PATH="$(abspath $(BIN)):$$PATH" bash scripts/bench.sh

# On a CUDA machine (the H200 device): kernels vs exllamav3 vs cuBLAS, then end-to-end decode
# (docs/gpu.md "How to run": carried wheels, fixtures and prebuilt cubins)
bench-gpu:
	bash bench/gpu_all.sh tests bench e2e

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache out
