#!/usr/bin/env bash
# Runs one integration test again and again, COPIES at once, to catch a rare failure: bounded
# by --rounds and --minutes, it stops by itself. A run that fails keeps its log; a run still
# going after --hang-after seconds gets a backtrace of every thread (gdb, if installed)
# before it is left to finish or time out, and keeps its log too. Debug logs of the nodes go to each run's log
# (PHALANX_TEST_LOG, see tests/common/log.rs), each log capped at --max-log-mb.
#
#   cluster/stress.sh --test allreduce --filter a_partition_root_killed \
#       [--copies 3] [--rounds 40] [--minutes 20] [--hang-after 25] [--log phalanx=debug] \
#       [--max-log-mb 400] [--out DIR]
#
# Prints one line per failure and a summary (runs, failures, hangs); exits 1 if any failed.
# Runs with several copies at once load the machine far more than CI does (which runs one
# test binary at a time): timing-sensitive expectations may fail there that pass in CI.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
test_name="" filter="" copies=3 rounds=40 minutes=20 hang_after=25 log="phalanx=debug"
max_log_mb=400 out=""
while [ $# -gt 0 ]; do
    case "$1" in
    --test) test_name=${2:?}; shift 2 ;;
    --filter) filter=${2:?}; shift 2 ;;
    --copies) copies=${2:?}; shift 2 ;;
    --rounds) rounds=${2:?}; shift 2 ;;
    --minutes) minutes=${2:?}; shift 2 ;;
    --hang-after) hang_after=${2:?}; shift 2 ;;
    --log) log=${2:?}; shift 2 ;;
    --max-log-mb) max_log_mb=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "stress.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -n "$test_name" ] || { echo "stress.sh: --test NAME (a file of tests/) is required" >&2; exit 2; }
out=${out:-$(mktemp -d "/tmp/phalanx-stress-$test_name.XXXX")}
mkdir -p "$out"

# The test binary, built once (cargo prints its path).
bin=$(cd "$ROOT" && cargo test --release --test "$test_name" --no-run 2>&1 |
    sed -n 's/.*Executable .*(\(.*\))$/\1/p' | tail -1)
[ -x "$ROOT/$bin" ] && bin="$ROOT/$bin"
[ -x "$bin" ] || { echo "stress.sh: no test binary for $test_name" >&2; exit 2; }
# A filter that matches no test would make every run "pass": refuse it up front.
matched=$("$bin" $filter --list 2>/dev/null | grep -c ': test$' || true)
[ "$matched" -gt 0 ] || { echo "stress.sh: no test of $test_name matches '$filter' (a substring, not a pattern)" >&2; exit 2; }
echo "stress.sh: $matched test(s) of $test_name match '$filter'" >&2

one_copy() {
    local copy=$1 end=$((SECONDS + minutes * 60)) i pid waited rc
    ulimit -f $((max_log_mb * 1024))
    for i in $(seq 1 "$rounds"); do
        [ "$SECONDS" -lt "$end" ] || break
        local logf="$out/run-$copy-$i.log"
        PHALANX_TEST_LOG="$log" timeout 300 "$bin" $filter --nocapture >"$logf" 2>&1 &
        pid=$!
        waited=0
        while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt $((hang_after * 2)) ]; do
            sleep 0.5
            waited=$((waited + 1))
        done
        local hung=0
        if kill -0 "$pid" 2>/dev/null; then
            hung=1
            echo "HANG copy $copy run $i (still going after ${hang_after}s): $logf" >>"$out/failures"
            if command -v gdb >/dev/null; then
                gdb -p "$(pgrep -P "$pid" | head -1 || echo "$pid")" -batch \
                    -ex "thread apply all bt" >"$out/gdb-$copy-$i.txt" 2>&1 || true
            fi
        fi
        rc=0
        wait "$pid" || rc=$?
        if [ "$rc" -ne 0 ]; then
            echo "FAIL copy $copy run $i (exit $rc): $logf" >>"$out/failures"
        elif [ "$hung" -eq 0 ]; then
            rm -f "$logf"
        fi
        echo "$copy $i" >>"$out/done"
    done
}

: >"$out/done"
: >"$out/failures"
for c in $(seq 1 "$copies"); do
    one_copy "$c" &
done
wait
runs=$(wc -l <"$out/done")
fails=$(grep -c '^FAIL' "$out/failures" || true)
hangs=$(grep -c '^HANG' "$out/failures" || true)
cat "$out/failures"
echo "stress.sh: $test_name ${filter:+($filter) }$runs runs, $fails failed, $hangs hung past ${hang_after}s; logs in $out"
[ "$fails" -eq 0 ]
