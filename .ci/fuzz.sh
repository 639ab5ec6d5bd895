#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/fuzz_targets: the TCP frame header, the control message
# decoder, the directory shard fed with decoded messages, the verbs eager block decoder) for a
# bounded time each, with AddressSanitizer, and prints each one's execution count. Any crash
# (panic, sanitizer report, leak) fails the run and leaves its input in fuzz/artifacts/.
#
#   bash .ci/fuzz.sh [SECONDS_PER_TARGET]     (default 20, or FUZZ_SECS)
#
# cargo-fuzz passes nightly-only flags (-Z sanitizer, ...) to rustc; the machine has only the
# stable toolchain, which accepts them under RUSTC_BOOTSTRAP=1 (set here, for these builds
# only).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-${FUZZ_SECS:-20}}
[[ $secs =~ ^[0-9]+$ ]] && [ "$secs" -ge 1 ] && [ "$secs" -le 3600 ] || { echo "fuzz.sh: seconds in 1..3600" >&2; exit 2; }
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install --locked cargo-fuzz
fi
export RUSTC_BOOTSTRAP=1
cd fuzz
cargo fuzz build --release
total=0
for t in $(cargo fuzz list); do
    log=$(mktemp)
    rc=0
    cargo fuzz run --release "$t" -- -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 >"$log" 2>&1 || rc=$?
    runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -n 1)
    if [ "$rc" != 0 ] || [ -z "$runs" ]; then
        echo "fuzz $t: FAILED (status $rc); last lines:" >&2
        tail -n 30 "$log" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
    total=$((total + runs))
    echo "fuzz $t: $runs executions in ${secs} s, 0 crashes"
done
echo "fuzz: $total executions in all, 0 crashes"
