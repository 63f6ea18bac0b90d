#!/bin/bash
# The 10M-kernel rows of docs/performance.md (issue 24) on the H200, in two device calls sent one after the other
# (a call lasts at most 10 minutes; the machine is kept between them only if the next comes within 30 s):
#
#   bash bench/export-10m-h200.sh record    # about 6 minutes: the eager 10M pair, both reports at once
#   bash bench/export-10m-h200.sh measure   # about 6 minutes: kvtrace's path and nsys stats on that pair
#
# carrying .gpu/nsys-env.sh, .gpu/nsys-libs and (record) .gpu/analyzer-deps (bench/h200-deps.sh download).
# kvtrace is laid out in /tmp/kv as `make bench-export-h200` does. bench/export.py's whole table at 10M (five
# export paths, each per report and for the pair) takes far longer than the device time of one session.
set -uo pipefail
source .gpu/nsys-env.sh
export PYTHONPATH=/tmp/kv:/tmp/site PYTHONUNBUFFERED=1
reports=/tmp/gl10m
timed() {  # timed OUTPUT COMMAND...: the command's output into OUTPUT, its wall time on standard output
  local out=$1 start=$(date +%s%N) status; shift
  "$@" > "$out" 2>&1
  status=$?
  echo "$(( ($(date +%s%N) - start) / 1000000 )) ms, exit $status: $*"
}
case ${1:-} in
record)
  bash bench/h200-deps.sh install > /tmp/deps.log 2>&1 || { tail /tmp/deps.log; exit 1; }
  rm -rf /tmp/kv && mkdir -p /tmp/kv $reports && cp -r kvtrace /tmp/kv/ && cp -r analyzer capture recipes /tmp/kv/kvtrace/
  # Its own process session, so that it outlives a call that ends early; the next call collects it.
  setsid nohup bash -c "python3 bench/graph_loop.py --record $reports --kernels 10000000 --eager --at-once \
    > $reports/record.log 2>&1; echo \$? > $reports/exit" < /dev/null > /dev/null 2>&1 &
  start=$(date +%s)
  while [ ! -f $reports/exit ] && (( $(date +%s) - start < 540 )); do sleep 5; done
  echo "recorded: exit $(cat $reports/exit 2>/dev/null || echo 'none yet') after $(( $(date +%s) - start )) s"
  ls -l $reports; dmesg 2>/dev/null | grep -i xid | tail -3
  ;;
measure)
  work=/tmp/export-10m && rm -rf $work && mkdir -p $work/diff $work/stats && cd $work
  # kvtrace's inputs and nsys stats' inputs in separate folders: nsys stats leaves an .sqlite beside its
  # input, which kvtrace would then take as the report's export.
  for v in a b; do cp $reports/$v-10000000.nsys-rep diff/; ln $reports/$v-10000000.nsys-rep stats/$v.nsys-rep; done
  nproc; $NSYS --version; ls -l $reports/*.nsys-rep
  export KVTRACE_CACHE_DIR=$work/cache
  diff=(python3 -m kvtrace diff diff/a-10000000.nsys-rep diff/b-10000000.nsys-rep)
  timed first.txt "${diff[@]}"
  timed repeat.txt "${diff[@]}"
  timed no-cache.txt "${diff[@]}" --no-cache
  timed imports.txt python3 -c "import kvtrace.analyzer.cli, kvtrace.analyzer.load"
  cmp -s first.txt no-cache.txt && cmp -s first.txt repeat.txt && echo "the three diffs print the same"
  python3 -c "import glob, polars as pl; [print(f, pl.scan_parquet(f).select(pl.len()).collect().item())
    for f in sorted(glob.glob('cache/exports/*/CUPTI_ACTIVITY_KIND_*.parquet'))]"
  start=$(date +%s%N)
  for v in a b; do timed stats-$v.csv $NSYS stats -q -r cuda_gpu_kern_sum -f csv:noconv -o - stats/$v.nsys-rep & done
  wait; echo "$(( ($(date +%s%N) - start) / 1000000 )) ms: nsys stats on both at once"
  tables=$(python3 -c "from kvtrace.analyzer.export_tables import EXPORT_TABLES as t; print(','.join(t))")
  mkdir parquet && start=$(date +%s%N)
  for v in a b; do timed parquet-$v.log $NSYS export --type=parquetdir --tables=$tables --force-overwrite=true \
    -o parquet/$v $reports/$v-10000000.nsys-rep & done
  wait; echo "$(( ($(date +%s%N) - start) / 1000000 )) ms: nsys export --type=parquetdir of both at once"
  ;;
*) echo "usage: $0 record|measure" >&2; exit 2 ;;
esac
