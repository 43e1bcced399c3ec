# The README's two commands: `make demo` (the main job) and `make test` (every test).
#
# Each target redoes only what changed, through stamps under build/:
#   deps     scripts/install_deps.sh, again when that script changes
#   build    the native library in place (setup.py build_ext --inplace: ninja recompiles only the
#            changed files), again when a file under csrc/, setup.py, the instantiation generator
#            or the build's settings (ASTR_FORCE_CPU, TORCH_CUDA_ARCH_LIST, ASTR_HEAD_DIM, torch's
#            version) change
#   install  an editable install of the Python package (no library: `build` makes it), again when
#            setup.py or pyproject.toml change
# `make clean` forgets all three.
PYTHON ?= python3
MAX_JOBS ?= $(shell nproc)
export MAX_JOBS

STAMPS := build/stamps
LIBRARY_SOURCES := $(shell find csrc -type f) setup.py scripts/generate_instantiations.py
# What the library was built with: a change rebuilds it (read without importing torch: fast).
BUILD_SETTINGS = $(ASTR_FORCE_CPU)|$(TORCH_CUDA_ARCH_LIST)|$(ASTR_HEAD_DIM)|$(shell $(PYTHON) -c \
	"import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null)

.PHONY: deps build adopt-library install demo info test test-python test-cpp compile-cuda bench tune format \
	lint clean FORCE

deps: $(STAMPS)/deps
$(STAMPS)/deps: scripts/install_deps.sh
	PYTHON=$(PYTHON) bash scripts/install_deps.sh
	@mkdir -p $(STAMPS) && touch $@

# Rewritten only when the settings differ from the last build's.
$(STAMPS)/settings: FORCE
	@mkdir -p $(STAMPS)
	@echo '$(BUILD_SETTINGS)' | cmp -s - $@ || echo '$(BUILD_SETTINGS)' > $@

build: $(STAMPS)/library
$(STAMPS)/library: $(LIBRARY_SOURCES) $(STAMPS)/settings | $(STAMPS)/deps
	@echo "make build: building astrai/_C (incremental; the first build takes minutes)"
	$(PYTHON) setup.py -q build_ext --inplace
	@touch $@

# CI: the library that the sdist's install built from these same sources, taken as this tree's
# build instead of building it a second time (.ci/run). LIBRARY=path/to/_C.abi3.so
adopt-library: $(STAMPS)/settings
	test -f "$(LIBRARY)"
	cp "$(LIBRARY)" astrai/
	@touch $(STAMPS)/library

install: build $(STAMPS)/install
$(STAMPS)/install: setup.py pyproject.toml | $(STAMPS)/deps
	ASTR_NO_EXTENSION=1 $(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	@mkdir -p $(STAMPS) && touch $@

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
	ruff format astrai tests benchmarks scripts examples setup.py
	ruff check --fix astrai tests benchmarks scripts examples setup.py

lint:
	clang-format --dry-run -Werror $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.cpp')
	ruff format --check astrai tests benchmarks scripts examples setup.py
	ruff check astrai tests benchmarks scripts examples setup.py

clean:
	rm -rf build build-cpp build-cu dist *.egg-info astrai/_C*.so
