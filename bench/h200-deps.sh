#!/bin/bash
# The analyzer's packages that the H200 image lacks, for bench runs that read traces there: polars, ADBC's
# SQLite driver, sqlite-utils with what it needs and a click new enough for it (the image has numpy, pyarrow,
# regex, rich and matplotlib).
#
#   bench/h200-deps.sh download [DIR]   on a CPU machine with pip and a package index: wheels into DIR
#                                       (default .gpu/analyzer-deps, ignored by git), about 38 MB
#   bench/h200-deps.sh install [DIR]    on the GPU machine (DIR carried): packages into /tmp/site;
#                                       then export PYTHONPATH=/tmp/site
#
# polars' runtime wheel is 54 MB, too much beside the tree in one 64 MiB carry; its files travel as xz
# (31 MB) and are unpacked as the wheel would install them.
set -euo pipefail
dir=${2:-.gpu/analyzer-deps}
runtime=polars-runtime-32
case ${1:-} in
download)
  version=2.1.0  # polars and its runtime share a version; 2.1.0 is the one the tests run on
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "polars==$version" "$runtime==$version" adbc-driver-sqlite==1.13.0 \
    adbc-driver-manager==1.13.0 sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4 click==8.4.0
  unpacked=$(mktemp -d)
  trap 'rm -rf "$unpacked"' EXIT
  wheel=$(ls "$dir"/polars_runtime_32-*.whl)
  python3 -m zipfile -e "$wheel" "$unpacked"
  tar -C "$unpacked" -cf - . | xz -T0 -9 >"$dir/$runtime.tar.xz.partial"
  mv "$dir/$runtime.tar.xz.partial" "$dir/$runtime.tar.xz" && rm "$wheel"
  du -sh "$dir"
  ;;
install)
  mkdir -p /tmp/site
  tar -xJf "$dir/$runtime.tar.xz" -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/*.whl
  PYTHONPATH=/tmp/site python3 -c "import polars, adbc_driver_sqlite, sqlite_utils; print('analyzer packages: polars', polars.__version__)"
  ;;
*) echo "usage: $0 download|install [DIR]" >&2; exit 2 ;;
esac
