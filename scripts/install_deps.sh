#!/usr/bin/env bash
# Installs what building and testing astrai needs, and nothing a user already has:
# torch 2.13.0 (CPU) only when no torch is importable (a user's CUDA torch is never replaced),
# the Python build/test tools, and GoogleTest from Debian's packages for the C++ tests.
set -euo pipefail
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "install_deps: no torch found; installing torch==2.13.0"
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi
"$PYTHON" -m pip install -q "setuptools>=64" wheel ninja pytest hypothesis numpy "ruff==0.17.6" "clang-format==23.1.5"
if [ "${ASTR_SKIP_GTEST:-0}" != "1" ] && [ ! -f /usr/include/gtest/gtest.h ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "install_deps: installing GoogleTest (libgtest-dev)"
    apt-get update -qq && apt-get install -y -qq libgtest-dev cmake >/dev/null
  else
    echo "install_deps: GoogleTest not found and apt-get unavailable; C++ tests will be skipped"
  fi
fi
