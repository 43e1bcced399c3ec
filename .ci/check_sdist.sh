#!/usr/bin/env bash
# The package as a user gets it: the sdist built from this checkout, installed without isolation
# into a fresh virtual environment that has torch (--system-site-packages: this machine's torch
# and build tools; astrai only from the sdist), then, from outside the checkout, imported, `info`
# run (text and --json) and every example run against the installed package.
#
#   bash .ci/check_sdist.sh [WORK_DIR]      (default build/ci-sdist; MAX_JOBS is honoured)
#
# Prints the installed library's path on its last line (.ci/run hands it to make adopt-library).
set -euo pipefail
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
WORK=$(realpath -m "${1:-$ROOT/build/ci-sdist}")
rm -rf "$WORK"
mkdir -p "$WORK/run"

step() { echo "check_sdist: $* ($((SECONDS - START)) s)" >&2; }
START=$SECONDS

"$PYTHON" -m build --sdist --no-isolation --outdir "$WORK/dist" . >"$WORK/sdist.log" 2>&1 ||
  { cat "$WORK/sdist.log" >&2; exit 1; }
SDIST=$(ls "$WORK"/dist/astrai-*.tar.gz)
step "built $(basename "$SDIST")"

# --without-pip: the venv's own (older) setuptools would hide this machine's; pip itself runs
# from the system site and installs into the venv.
"$PYTHON" -m venv --system-site-packages --without-pip "$WORK/venv"
VENV_PYTHON="$WORK/venv/bin/python"
"$VENV_PYTHON" -m pip install -q --no-build-isolation --no-deps "$SDIST" >"$WORK/install.log" 2>&1 ||
  { cat "$WORK/install.log" >&2; exit 1; }
step "installed it in $WORK/venv"

cd "$WORK/run"  # outside the checkout: astrai comes from the venv
"$VENV_PYTHON" - "$WORK/venv" <<'PY'
import sys, importlib.metadata as metadata
import astrai
assert astrai.__file__.startswith(sys.argv[1]), f"astrai imported from {astrai.__file__}"
print(f"check_sdist: astrai {metadata.version('astrai')} imports from {astrai.__file__}", file=sys.stderr)
PY
"$VENV_PYTHON" -m astrai.extension.info >&2
"$VENV_PYTHON" -m astrai.extension.info --json >"$WORK/info.json"
for example in "$ROOT"/examples/*.py; do
  "$VENV_PYTHON" "$example" >"$WORK/$(basename "$example" .py).log" 2>&1 ||
    { echo "check_sdist: $example failed:" >&2; cat "$WORK/$(basename "$example" .py).log" >&2; exit 1; }
done
step "info and $(ls "$ROOT"/examples/*.py | wc -l) examples ran against the installed package"
"$VENV_PYTHON" -c "import os, astrai.extension.ops as o, glob; print(glob.glob(os.path.join(os.path.dirname(os.path.dirname(o.__file__)), '_C*.so'))[0])"
