# The README's two commands: `make demo` (the main job) and `make test` (every test).
PYTHON ?= python3
MAX_JOBS ?= $(shell nproc)
export MAX_JOBS

.PHONY: deps install demo info test test-python test-cpp compile-cuda bench tune format lint clean

deps:
	PYTHON=$(PYTHON) bash scripts/install_deps.sh

install: deps
	$(PYTHON) -m pip install -q --no-build-isolation -e .

demo: install
	$(PYTHON) -m astrai.demo

info: install
	$(PYTHON) -m astrai.extension.info

test: install test-python test-cpp

test-python:
	$(PYTHON) -m pytest -q tests

test-cpp:
	cmake -S tests/cpp -B build-cpp -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build-cpp
	ctest --test-dir build-cpp --output-on-failure

compile-cuda:
	$(PYTHON) scripts/compile_cuda.py

bench: install  # BENCH_ARGS="--quick", "--baseline-lib PATH": benchmarks/README.md
	$(PYTHON) benchmarks/bench_attention.py $(BENCH_ARGS)

# The resolver's measured preferences (csrc/dispatch/preference_table.inc) from benchmark runs of
# record that timed the cuda and flash backends together: TUNE_RUNS="benchmarks/results/<run>.json".
TUNE_RUNS ?= benchmarks/results/prefill_fa3_fa4_NVIDIA-H100_2026-12-05_2da085e.json \
	benchmarks/results/prefill_fa3_fa4_noncausal_NVIDIA-H100_2026-12-05_2da085e.json
tune:
	$(PYTHON) benchmarks/tune_preferences.py $(TUNE_RUNS)

format:
	clang-format -i $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.cpp')
	ruff format astrai tests benchmarks scripts setup.py
	ruff check --fix astrai tests benchmarks scripts setup.py

lint:
	clang-format --dry-run -Werror $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.cpp')
	ruff format --check astrai tests benchmarks scripts setup.py
	ruff check astrai tests benchmarks scripts setup.py

clean:
	rm -rf build build-cpp build-cu *.egg-info astrai/_C*.so
