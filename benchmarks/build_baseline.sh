#!/usr/bin/env bash
# Builds astrai's library as it was at COMMIT, its op namespace renamed (astr -> astr_old, or
# $BASELINE_NAMESPACE), so that bench_attention.py --baseline-lib can load it beside this build
# and time both in one process:
#
#   bash benchmarks/build_baseline.sh 2be0c0e /tmp/baseline      # prints the library's path
#   python3 benchmarks/bench_attention.py --baseline-lib /tmp/baseline/astrai/_C.abi3.so
#
# Only COMMIT's csrc/, scripts/ (the build reads its generators) and setup.py are taken (git
# archive); the library lands in OUTDIR/astrai/,
# and OUTDIR/BASELINE.json records the commit, which the benchmark writes into its results. The
# build honours what setup.py reads (TORCH_CUDA_ARCH_LIST, MAX_JOBS, NVCC_THREADS,
# ASTR_FORCE_CPU=1 for a CPU build).
#
# For a machine without the git history (a GPU machine that gets a copy of the working tree):
# export here with BASELINE_EXPORT_ONLY=1 into a folder of the tree, then run the script there
# with COMMIT "-", which builds the sources already exported in OUTDIR.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 COMMIT|- OUTDIR   (BASELINE_NAMESPACE, default astr_old; BASELINE_EXPORT_ONLY=1)" >&2
  exit 2
fi
commit_arg=$1
out=$2
namespace=${BASELINE_NAMESPACE:-astr_old}
python=${PYTHON:-python3}

mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ "$commit_arg" = "-" ]; then
  if [ ! -f "$out/BASELINE.json" ] || [ ! -d "$out/csrc" ]; then
    echo "$0: COMMIT '-' builds sources exported before, but $out has none" >&2
    exit 2
  fi
  namespace=$("$python" -c "import json, sys; print(json.load(open(sys.argv[1]))['namespace'])" \
    "$out/BASELINE.json")
else
  if [ -e "$out/csrc" ]; then
    echo "$0: $out/csrc exists; give an empty or new OUTDIR (or COMMIT '-' to build it)" >&2
    exit 2
  fi
  root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
  commit=$(git -C "$root" rev-parse --verify "$commit_arg^{commit}")
  git -C "$root" archive "$commit" csrc setup.py scripts | tar -x -C "$out"

  # The namespace appears in the schema block, in each kernel registration and in the operator
  # names that C++ looks up ("astr::..."). The C++ namespace (astr; astrai before 2026-12-07) is
  # renamed too (in the sources and in the generator of the instantiation files): both
  # libraries live in one process, and a C++ symbol of the same name in both (an inline constexpr
  # table, a plan function) resolved to the first library loaded, so the baseline ran this
  # build's plan with its own kernels.
  find "$out/csrc" -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) \
    -exec sed -i \
      -e "s/TORCH_LIBRARY(astr,/TORCH_LIBRARY($namespace,/g" \
      -e "s/TORCH_LIBRARY_FRAGMENT(astr,/TORCH_LIBRARY_FRAGMENT($namespace,/g" \
      -e "s/TORCH_LIBRARY_IMPL(astr,/TORCH_LIBRARY_IMPL($namespace,/g" \
      -e "s/\"astr::/\"$namespace::/g" \
      -e "s/\bnamespace astrai\b/namespace astrai_$namespace/g" \
      -e "s/\bastrai::/astrai_$namespace::/g" \
      -e "s/\bnamespace astr\b/namespace $namespace/g" \
      -e "s/\bastr::/$namespace::/g" {} +
  find "$out/scripts" -type f -name '*.py' -exec sed -i \
    -e "s/\bnamespace astrai\b/namespace astrai_$namespace/g" \
    -e "s/\bastrai::/astrai_$namespace::/g" \
    -e "s/\bnamespace astr\b/namespace $namespace/g" \
    -e "s/\bastr::/$namespace::/g" {} +
  left=$(grep -rnE 'TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(astr,|"astr::|"astr"' "$out/csrc" || true)
  if [ -n "$left" ]; then
    echo "$0: the namespace is still astr here (a form this script does not rename):" >&2
    echo "$left" >&2
    exit 1
  fi
  if ! grep -rq "TORCH_LIBRARY($namespace," "$out/csrc"; then
    echo "$0: no TORCH_LIBRARY($namespace, ...) after renaming: is $commit an astrai commit?" >&2
    exit 1
  fi
  printf '{"commit": "%s", "namespace": "%s"}\n' "$commit" "$namespace" >"$out/BASELINE.json"
fi

if [ "${BASELINE_EXPORT_ONLY:-0}" = 1 ]; then
  echo "exported to $out; build it with: bash $0 - $out" >&2
  exit 0
fi
mkdir -p "$out/astrai"
(cd "$out" && "$python" setup.py build_ext --inplace) >"$out/build.log" 2>&1 || {
  tail -30 "$out/build.log" >&2
  exit 1
}
ls "$out"/astrai/_C*.so
