#!/usr/bin/env bash
# Builds astrai's library as it was at COMMIT, its op namespace renamed (astr -> astr_old, or
# $BASELINE_NAMESPACE), so that bench_attention.py --baseline-lib can load it beside this build
# and time both in one process:
#
#   bash benchmarks/build_baseline.sh 2be0c0e /tmp/baseline
#   python3 benchmarks/bench_attention.py --baseline-lib /tmp/baseline/astrai/_C.abi3.so
#
# Only COMMIT's csrc/ and setup.py are taken (git archive); the library lands in OUTDIR/astrai/,
# and OUTDIR/BASELINE.json records the commit, which the benchmark writes into its results. The
# build honours what setup.py reads (TORCH_CUDA_ARCH_LIST, MAX_JOBS, NVCC_THREADS,
# ASTR_FORCE_CPU=1 for a CPU build).
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 COMMIT OUTDIR   (BASELINE_NAMESPACE, default astr_old)" >&2
  exit 2
fi
commit_arg=$1
out=$2
namespace=${BASELINE_NAMESPACE:-astr_old}
python=${PYTHON:-python3}
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
commit=$(git -C "$root" rev-parse --verify "$commit_arg^{commit}")

mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ -e "$out/csrc" ]; then
  echo "$0: $out/csrc exists; give an empty or new OUTDIR" >&2
  exit 2
fi
git -C "$root" archive "$commit" csrc setup.py | tar -x -C "$out"

# The namespace appears in the schema block, in each kernel registration and in the operator
# names that C++ looks up ("astr::..."); C++ namespaces (astr::dispatch) stay as they are.
find "$out/csrc" -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) \
  -exec sed -i \
    -e "s/TORCH_LIBRARY(astr,/TORCH_LIBRARY($namespace,/g" \
    -e "s/TORCH_LIBRARY_FRAGMENT(astr,/TORCH_LIBRARY_FRAGMENT($namespace,/g" \
    -e "s/TORCH_LIBRARY_IMPL(astr,/TORCH_LIBRARY_IMPL($namespace,/g" \
    -e "s/\"astr::/\"$namespace::/g" {} +
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

mkdir -p "$out/astrai"
(cd "$out" && "$python" setup.py build_ext --inplace) >"$out/build.log" 2>&1 || {
  tail -30 "$out/build.log" >&2
  exit 1
}
lib=$(ls "$out"/astrai/_C*.so)
printf '{"commit": "%s", "namespace": "%s"}\n' "$commit" "$namespace" >"$out/BASELINE.json"
echo "$lib"
