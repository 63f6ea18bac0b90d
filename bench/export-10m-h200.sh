#!/bin/bash
# The 10M-kernel rows of docs/performance.md (issue 24) on the H200. A device call lasts at most 10 minutes and
# the machine is kept between calls only if the next comes within 30 s, so the steps run in the background, in
# their own process session, and each call waits for them up to WAIT_S seconds (default 540):
#
#   bash bench/export-10m-h200.sh start record paths   # first call: steps in the background, then wait
#   bash bench/export-10m-h200.sh wait                  # each next call, sent at once: wait, show, archive
#   bash bench/export-10m-h200.sh start verify          # once the steps before it are done
#
# Steps: record (the eager 10M pair, both reports at once, about 6 minutes); measure (the first, repeat and
# no-cache diffs, nsys stats, and the SQLite export kvtrace makes with kvtrace's read of it, about 6 minutes);
# paths (bench/export.py's five export paths with the pair at once, their reads and the exactness check, about
# 10 minutes); verify (a first `kvtrace diff --verify` of the pair, about 7 minutes); eager_sizes (eager pairs of
# SIZES kernels, default 1M and 2M, SQLite --tables against Parquet with the pair at once, about 4 minutes). Carry
# .gpu/nsys-env.sh, .gpu/nsys-libs and .gpu/analyzer-deps (bench/h200-deps.sh download). `start` lays kvtrace out
# in /tmp/kv from the call's tree, as `make bench-export-h200` does; each wait copies the step logs into $OUT.
set -uo pipefail
source .gpu/nsys-env.sh
export PYTHONPATH=/tmp/kv:/tmp/site PYTHONUNBUFFERED=1
reports=/tmp/gl10m
logs=/tmp/export-10m-logs
timed() {  # timed OUTPUT COMMAND...: the command's output into OUTPUT, its wall time on standard output
  local out=$1 start=$(date +%s%N) status; shift
  "$@" > "$out" 2>&1
  status=$?
  echo "$(( ($(date +%s%N) - start) / 1000000 )) ms, exit $status: $*"
}
record() {
  mkdir -p $reports
  python3 bench/graph_loop.py --record $reports --kernels 10000000 --eager --at-once
  local status=$?
  ls -l $reports; dmesg 2>/dev/null | grep -i xid | tail -3
  return $status
}
measure() {
  local work=/tmp/export-10m
  rm -rf $work && mkdir -p $work/diff $work/stats && cd $work
  # kvtrace's inputs and nsys stats' inputs in separate folders: nsys stats leaves an .sqlite beside its
  # input, which kvtrace would then take as the report's export.
  for v in a b; do cp $reports/$v-10000000.nsys-rep diff/; ln $reports/$v-10000000.nsys-rep stats/$v.nsys-rep; done
  nproc; $NSYS --version; ls -l $reports/*.nsys-rep
  export KVTRACE_CACHE_DIR=$work/cache
  local diff=(python3 -m kvtrace diff diff/a-10000000.nsys-rep diff/b-10000000.nsys-rep)
  timed first.txt "${diff[@]}"
  timed repeat.txt "${diff[@]}"
  timed no-cache.txt "${diff[@]}" --no-cache
  timed imports.txt python3 -c "import kvtrace.analyzer.cli, kvtrace.analyzer.load"
  cmp -s first.txt no-cache.txt && cmp -s first.txt repeat.txt && echo "the three diffs print the same"
  local start=$(date +%s%N)
  for v in a b; do timed stats-$v.csv $NSYS stats -q -r cuda_gpu_kern_sum -f csv:noconv -o - stats/$v.nsys-rep & done
  wait; echo "$(( ($(date +%s%N) - start) / 1000000 )) ms: nsys stats on both at once"
  # The export kvtrace makes at this size, by hand (its own command, kvtrace.nsys.export_command), and kvtrace's
  # read of it: the first diff's floor, in this run.
  local export_a=() export_b=() v
  for v in a b; do  # built before the clock starts: Python's start is not the export's
    mapfile -t export_$v < <(python3 -c "import sys; from kvtrace.nsys import export_command
from kvtrace.analyzer.export_tables import EXPORT_TABLES
print(*export_command(*sys.argv[1:], tables=EXPORT_TABLES), sep='\n')" $NSYS $reports/$v-10000000.nsys-rep sqlite/$v.sqlite)
  done
  mkdir sqlite && start=$(date +%s%N)
  timed sqlite-a.log "${export_a[@]}" & timed sqlite-b.log "${export_b[@]}" &
  wait; echo "$(( ($(date +%s%N) - start) / 1000000 )) ms: nsys export --type=sqlite --tables of both at once"
  timed read.txt python3 -m kvtrace diff sqlite/a.sqlite sqlite/b.sqlite --no-cache
}
paths() {
  python3 bench/export.py --repeat 1 --pair-only --no-diff $reports/a-10000000.nsys-rep $reports/b-10000000.nsys-rep
}
eager_sizes() {  # where Parquet stops being the faster export: eager pairs of SIZES kernels (default 1M and 2M)
  local n
  for n in ${SIZES:-1000000 2000000}; do
    python3 bench/graph_loop.py --record /tmp/eager --kernels $n --eager --at-once || return
    python3 bench/export.py /tmp/eager/a-$n.nsys-rep /tmp/eager/b-$n.nsys-rep --repeat 1 --pair-only --no-diff \
      --exports sqlite-tables parquetdir || return
  done
}
verify() {
  local work=/tmp/export-10m-verify
  rm -rf $work && mkdir -p $work/diff && cd $work
  for v in a b; do cp $reports/$v-10000000.nsys-rep diff/; done
  export KVTRACE_CACHE_DIR=$work/cache
  timed verify.txt python3 -m kvtrace diff --verify diff/a-10000000.nsys-rep diff/b-10000000.nsys-rep
  cat verify.txt
}
case ${1:-} in
start)
  shift
  [ -d /tmp/site/polars ] || { bash bench/h200-deps.sh install > /tmp/deps.log 2>&1 || { tail /tmp/deps.log; exit 1; }; }
  rm -rf /tmp/kv && mkdir -p /tmp/kv $logs && cp -r kvtrace /tmp/kv/ && cp -r analyzer capture recipes /tmp/kv/kvtrace/
  rm -f $logs/done && : > $logs/steps
  setsid nohup bash "$0" run "$@" < /dev/null > /dev/null 2>&1 &
  exec bash "$0" wait
  ;;
run)  # the steps in order, each logged; stops at the first that fails
  shift
  for step in "$@"; do
    echo "$step started $(date +%T)" >> $logs/steps
    ($step) > $logs/$step.log 2>&1
    status=$?
    echo "$step exit $status $(date +%T)" >> $logs/steps
    [ $status = 0 ] || break
  done
  touch $logs/done
  ;;
wait)
  # A machine given back between calls comes back bare: nothing to wait for.
  [ -f $logs/steps ] || { echo "no steps on this machine: it was given back since \`start\`; start them again" >&2; exit 2; }
  start=$(date +%s)
  while [ ! -f $logs/done ] && (( $(date +%s) - start < ${WAIT_S:-540} )); do sleep 5; done
  cat $logs/steps; [ -f $logs/done ] && echo "all steps ended" || echo "still running after $(( $(date +%s) - start )) s"
  for log in $logs/*.log; do echo "== $log"; tail -n 40 "$log"; done
  [ -n "${OUT:-}" ] && tar -C $logs -czf "$OUT/export-10m-logs.tar.gz" .
  ;;
*) echo "usage: $0 start STEP... | wait   (steps: record measure paths verify eager_sizes)" >&2; exit 2 ;;
esac
