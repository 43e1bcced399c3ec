#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4: pure Python over NVIDIA's CUTLASS DSL) for a GPU machine that
# cannot reach a package index, carried as wheels in two parts because the CUTLASS DSL's compiler
# library (193 MB, 92 MB as a wheel) is more than one transfer may carry.
#
#   here:        scripts/flash_wheels.sh prepare        -> .whl/part-a (compiler, xz), .whl/part-b
#   GPU, call 1: scripts/flash_wheels.sh stash          (carry .whl/part-a; kept in /tmp)
#   GPU, call 2: source scripts/flash_wheels.sh install (carry .whl/part-b; sets PYTHONPATH)
#
# .whl/ is ignored by git (.git/info/exclude). Versions: flash-attn-4 4.0.0b36, CUTLASS DSL 4.8.1
# for CUDA 13, Python 3.12 on x86-64.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHL=$ROOT/.whl
STASH=/tmp/astrai-flash-stash
SITE=/tmp/astrai-flash-site
CUTLASS=4.8.1
IR_SO=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so

prepare() {
  set -e
  grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >>"$ROOT/.git/info/exclude"
  rm -rf "$WHL" && mkdir -p "$WHL/download" "$WHL/part-a" "$WHL/part-b"
  local platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64"
  platforms+=" --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
  platforms+=" --platform manylinux2014_x86_64"
  for package in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==$CUTLASS \
    nvidia-cutlass-dsl-libs-base==$CUTLASS nvidia-cutlass-dsl-libs-core==$CUTLASS \
    nvidia-cutlass-dsl-libs-cu13==$CUTLASS "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext \
    quack-kernels==0.6.5; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp $platforms -d "$WHL/download" "$package"
  done
  # The CUDA 13 library wheel: its compiler library goes alone (xz), the rest as one tarball.
  local unpacked=$WHL/download/cu13
  mkdir -p "$unpacked"
  unzip -q "$WHL"/download/nvidia_cutlass_dsl_libs_cu13-*.whl -d "$unpacked"
  xz -9e -T0 -c "$unpacked/$IR_SO" >"$WHL/part-a/cutlass_ir.so.xz"
  rm "$unpacked/$IR_SO"
  tar -C "$unpacked" -cJf "$WHL/part-b/cutlass_libs_cu13.tar.xz" .
  find "$WHL/download" -maxdepth 1 -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' \
    -exec mv {} "$WHL/part-b/" \;
  rm -rf "$WHL/download"
  du -sh "$WHL"/part-*
}

stash() {
  mkdir -p "$STASH" && cp "$WHL"/part-a/* "$STASH"/ && ls -l "$STASH"
}

install() {
  [ -f "$STASH/cutlass_ir.so.xz" ] || { echo "flash_wheels: no stash (run 'stash' first, same machine)"; return 1; }
  rm -rf "$SITE" && mkdir -p "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHL"/part-b/*.whl || return 1
  tar -C "$SITE" -xJf "$WHL/part-b/cutlass_libs_cu13.tar.xz" || return 1
  xz -dc "$STASH/cutlass_ir.so.xz" >"$SITE/$IR_SO" && chmod +x "$SITE/$IR_SO" || return 1
  # The meta wheel's .pth (which puts dsl_packages on sys.path) is not read from PYTHONPATH.
  export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import flash_attn.cute as m; print('flash_attn.cute imported:', m.__file__)"
}

case "${1:-}" in
  prepare | stash | install) "$1" ;;
  *) echo "usage: $0 prepare|stash|install" >&2 ;;
esac
