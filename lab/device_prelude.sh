# Sourced by the lab's H200 scripts: unpacks the libraries carried as .devbuild/ab/libs.tar.xz
# (stripped .so files, xz: the carry limit is 64 MiB), puts the tree on PYTHONPATH and logs the
# call to $OUT/session.log.
[ -f .devbuild/ab/libs.tar.xz ] && tar -xJf .devbuild/ab/libs.tar.xz -C .devbuild
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec > >(tee "$OUT/session.log") 2>&1
