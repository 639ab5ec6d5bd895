#!/usr/bin/env bash
# The measurement behind README's "Benchmarks on emulated hosts", start to end:
#
#   cluster/bench-netns.sh [--config cluster/examples/netns-8.toml] [--rate 1gbit]
#                          [--sizes 64M,16M,1M,64K,1K] [--iters 5] [--out FILE]
#                          [--sweep-size 16M]
#
# 1. makes the emulated hosts (cluster/netns.sh up N --rate R);
# 2. measures with iperf3 the TCP goodput G of one host's link (3 x 10 s, median), and the
#    machine's CPU while every host sends to the next at full rate;
# 3. runs, through cluster/run.sh, each with --json, appending the records to FILE (default
#    cluster/results/netns-N-RATE.jsonl; "#" lines note the commands, iperf3 and the CPU):
#      phalanx bench reduce,allreduce,broadcast --algo phalanx      (degree auto)
#      phalanx bench reduce,broadcast --algo star
#      phalanx bench reduce,allreduce --degree 1 / 2 / n
#      phalanx bench reduce,allreduce --arrival-interval-ms 5 / 10 / 20 / 40   (16M and 1K)
#      phalanx bench reduce --algo star --arrival-interval-ms 5 / 10 / 20 / 40 (16M and 1K)
#    with the sizes largest first: the bench has no final barrier, so ranks other than 0 leave
#    0.3 s after their own last step (taking their directory shard and their copies with
#    them); ending every run on the smallest size keeps that last step short for everyone;
# 4. renders the plots next to FILE and prints the table (cluster/table.sh FILE).
#
# Needs root, iperf3 and target/release/phalanx (cargo build --release -p phalanx-cli; set
# PHALANX_BIN to use another binary). Every step is bounded in time; the hosts are removed at
# the end and on Ctrl-C. Other work on a 2-core machine shows up in the timings, so before each
# step it waits (up to 10 minutes) for the machine to be quiet (QUIET_PCT, default 15 % busy),
# and it runs iperf3 and the ranks at nice -10 (NICE=0 to not).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
BIN=${PHALANX_BIN:-$ROOT/target/release/phalanx}
SUBNET=${PHX_SUBNET:-10.77.0}

config=$HERE/examples/netns-8.toml rate=1gbit sizes=64M,16M,1M,64K,1K iters=5 out=""
sweep_size=16M run_timeout=1800 quiet_pct=${QUIET_PCT:-15} nice_n=${NICE:--10}
while [ $# -gt 0 ]; do
    case $1 in
    --config) config=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --sweep-size) sweep_size=$2; shift 2 ;;
    -h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-netns.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
# Largest first (see 3. above).
sizes=$(tr ',' '\n' <<<"$sizes" | awk '{ v = $1; m = 1; u = toupper(substr(v, length(v)));
    if (u == "K") m = 1024; else if (u == "M") m = 1048576; else if (u == "G") m = 1073741824;
    if (m > 1) v = substr(v, 1, length(v) - 1); print v * m, $1 }' | sort -rn | cut -d" " -f2 | paste -sd,)
[ "$(id -u)" = 0 ] || { echo "bench-netns.sh: needs root" >&2; exit 1; }
command -v iperf3 >/dev/null || { echo "bench-netns.sh: needs iperf3 (apt-get install iperf3)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "bench-netns.sh: no $BIN (cargo build --release -p phalanx-cli)" >&2; exit 1; }
n=$(grep -c '^[[:space:]]*\[\[nodes\]\]' "$config")
out=${out:-$HERE/results/netns-$n-$rate.jsonl}
mkdir -p "$(dirname "$out")"

note() { echo "# $*" | tee -a "$out"; }

# shellcheck source=cluster/cpu.sh
. "$HERE/cpu.sh"

wait_quiet() {
    local b deadline=$((SECONDS + 600))
    while :; do
        b=$(busy 2)
        [ "$b" -le "$quiet_pct" ] && return 0
        if [ $SECONDS -ge $deadline ]; then
            note "warning: the machine was still ${b}% busy with other work; measuring anyway"
            return 0
        fi
        echo "bench-netns.sh: machine ${b}% busy with other work; waiting" >&2
        sleep 10
    done
}

cleanup() { "$HERE/netns.sh" down >/dev/null 2>&1 || true; }
trap cleanup EXIT
trap 'echo "bench-netns.sh: interrupted" >&2; exit 130' INT TERM

# Someone else's job on existing emulated hosts: wait for it (up would refuse anyway).
for ((i = 0; i < 60; i++)); do
    busy_pids=$(for ns in $(ip netns list | awk '{print $1}' | grep -E '^phx-'); do ip netns pids "$ns"; done)
    [ -z "$busy_pids" ] && break
    echo "bench-netns.sh: the emulated hosts are in use (pids $(echo $busy_pids)); waiting" >&2
    sleep 10
done
"$HERE/netns.sh" up "$n" --rate "$rate"
note "$(date -u +%FT%TZ) $n emulated hosts at $rate per host (cluster/netns.sh up $n --rate $rate), \
$(nproc) cores, kernel $(uname -r), config $(basename "$config"): \
$(grep -E '^(chunk_size|socket_buffer|arena_size)' "$config" | sed 's/ *#.*//' | tr '\n' ' ')"
note "binary $BIN ($(sha256sum "$BIN" | cut -c1-12)), source tree at \
$(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)"

# iperf3: JSON "sum_received" bits_per_second of a client run.
recv_bps() { awk -F'[:,]' '/"sum_received"/ { s = 1 } s && /"bits_per_second"/ { printf "%.0f", $2; exit }' "$1"; }

wait_quiet
tmp=$(mktemp -d)
runs=()
for r in 1 2 3; do
    ip netns exec phx-0 timeout 40 nice -n "$nice_n" iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
    srv=$!
    sleep 0.3
    ip netns exec phx-1 timeout 30 nice -n "$nice_n" iperf3 -c "$SUBNET.1" -p 5201 -t 10 -O 2 -J >"$tmp/i$r" 2>/dev/null || true
    wait $srv 2>/dev/null || true
    runs+=("$(recv_bps "$tmp/i$r")")
done
g_bps=$(printf '%s\n' "${runs[@]}" | sort -n | sed -n 2p)
[ -n "$g_bps" ] && [ "$g_bps" -gt 0 ] || { echo "bench-netns.sh: iperf3 failed" >&2; exit 1; }
note "iperf3 goodput_gbit_s=$(awk -v b="$g_bps" 'BEGIN { printf "%.4f", b / 1e9 }') \
(one flow host 1 -> host 0, 10 s after 2 s omitted, median of 3: ${runs[*]} bit/s)"

# Every host sending to the next at once: do all links still reach G, and how busy is the CPU?
srvs=() clis=()
for ((k = 0; k < n; k++)); do
    ip netns exec "phx-$k" timeout 40 nice -n "$nice_n" iperf3 -s -1 -p 5301 >/dev/null 2>&1 &
    srvs+=($!)
done
sleep 0.5
for ((k = 0; k < n; k++)); do
    ip netns exec "phx-$k" timeout 30 nice -n "$nice_n" iperf3 -c "$SUBNET.$(((k + 1) % n + 1))" -p 5301 -t 10 -J \
        >"$tmp/ring$k" 2>/dev/null &
    clis+=($!)
done
sleep 2
cpu=$(busy 6)
wait "${clis[@]}" || true
wait "${srvs[@]}" 2>/dev/null || true
ring=""
for ((k = 0; k < n; k++)); do ring+="$(awk -v b="$(recv_bps "$tmp/ring$k")" 'BEGIN { printf "%.0f ", b / 1e6 }')"; done
rm -rf "$tmp"
note "iperf3 ring (host k -> k+1, all at once): ${ring}Mbit/s; machine CPU busy ${cpu}%"

# bench TAG ARGS...: one run of the SPMD bench on every host; its records are appended to the
# results, tagged with "degree_requested":TAG when TAG is set.
bench() {
    local tag=$1 try res sizes=${BENCH_SIZES:-$sizes}
    shift
    res=$(mktemp)
    for try in 1 2; do
        wait_quiet
        note "$(date -u +%FT%TZ) cluster/run.sh $(basename "$config") -- phalanx bench $* --size $sizes --iters $iters --json"
        if "$HERE/run.sh" --timeout "$run_timeout" --nice "$nice_n" "$config" -- "$BIN" bench "$@" \
            --config "$config" --size "$sizes" --iters "$iters" --json >"$res"; then
            [ -n "$tag" ] && sed -i "/^{/ s/}\$/,\"degree_requested\":\"$tag\"}/" "$res"
            tee -a "$out" <"$res"
            rm -f "$res"
            return 0
        fi
        note "that run failed (try $try)"
    done
    rm -f "$res"
    return 1
}

status=0
bench auto reduce,allreduce,broadcast --algo phalanx || status=1
bench "" reduce,broadcast --algo star || status=1
for d in 1 2 n; do
    bench "$d" reduce,allreduce --degree "$d" || status=1
done
# Inputs arriving one after another: rank k's input is ready k * interval late.
for ms in 5 10 20 40; do
    BENCH_SIZES=$sweep_size,1K bench auto reduce,allreduce --arrival-interval-ms "$ms" || status=1
    BENCH_SIZES=$sweep_size,1K bench "" reduce --algo star --arrival-interval-ms "$ms" || status=1
done

if "$BIN" plot --help >/dev/null 2>&1; then
    "$BIN" plot "$out" --out "$(dirname "$out")"
else
    (cd "$ROOT" && cargo run --release --quiet -p phalanx-cli -- plot "$out" --out "$(dirname "$out")")
fi
"$HERE/table.sh" "$out"
exit $status
