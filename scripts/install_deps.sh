#!/usr/bin/env bash
# Installs what building and testing astrai needs, and nothing a user already has:
# torch 2.13.0 (CPU) only when no torch is importable (a user's CUDA torch is never replaced),
# the Python build/test tools, transformers (for the integration and the demo), and GoogleTest
# from Debian's packages for the C++ tests.
set -euo pipefail
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "install_deps: no torch found; installing torch==2.13.0"
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi
"$PYTHON" -m pip install -q "setuptools>=77" wheel ninja build pytest hypothesis numpy "ruff==0.17.6" "clang-format==23.1.5"
# The transformers integration, its tests and the demo: the tested range when transformers is
# missing (a transformers you have is kept; astrai warns if it is outside that range). psutil
# lets transformers' continuous batching size its cache on a CPU. Neither pulls in torch.
if ! "$PYTHON" -c "import transformers" >/dev/null 2>&1; then
  echo "install_deps: no transformers found; installing transformers>=5.17,<5.26"
  "$PYTHON" -m pip install -q "transformers>=5.17,<5.26"
fi
if ! "$PYTHON" -c "import psutil" >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q psutil
fi
if [ "${ASTR_SKIP_GTEST:-0}" != "1" ] && [ ! -f /usr/include/gtest/gtest.h ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "install_deps: installing GoogleTest (libgtest-dev)"
    apt-get update -qq && apt-get install -y -qq libgtest-dev cmake >/dev/null
  else
    echo "install_deps: GoogleTest not found and apt-get unavailable; C++ tests will be skipped"
  fi
fi
