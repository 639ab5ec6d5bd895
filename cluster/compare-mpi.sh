#!/usr/bin/env bash
# Phalanx next to Open MPI on the same emulated hosts, same sizes, one run:
#
#   cluster/compare-mpi.sh [--sizes 1K,64K,1M,16M,64M] [--iters N|N1,N2,..] [--warmup W|W1,..]
#                          [--nodes 8] [--rate 1gbit] [--phalanx-bin target/release/phalanx]
#                          [--out FILE] [--collectives broadcast,reduce,allreduce,gather]
#                          [--nice N] [--timeout S] [--wait-quiet PCT] [--skip-mpi] [--skip-phalanx]
#                          [--interval MS] [--inputs put|written]
#
# 1. Hosts: reuses the namespaces phx-0..phx-(N-1) of cluster/netns.sh when they exist and
#    nothing runs on them (else refuses); otherwise makes them (netns.sh up N --rate R) and
#    removes them again on exit and on Ctrl-C.
# 2. Open MPI (Debian's openmpi-bin + libopenmpi-dev; installed with apt-get when missing):
#    builds our benchmark cluster/mpi/collbench.c with mpicc into target/mpi/collbench and runs
#    it once with Open MPI's default decision ("mpi-default", every collective), then once per
#    forced coll/tuned algorithm ("mpi-tuned-NAME": --mca coll_tuned_use_dynamic_rules 1
#    --mca coll_tuned_<coll>_algorithm K [..._segmentsize B]; the list is MPI_CONFIGS below).
#    Placement: mpirun itself runs in phx-0, with a hostfile of 10.77.0.1..N (slots=1 each) and
#    --map-by node, so rank K runs on host 10.77.0.(K+1); the daemons of the other hosts are
#    started by Open MPI's rsh launcher through cluster/mpi/netns-agent.sh, which runs them
#    with `ip netns exec phx-K` instead of ssh (and gives each host its own hostname, phx-K,
#    in a UTS namespace: with one shared hostname a daemon now and then died at start-up). Traffic: --mca pml ob1 --mca btl "tcp,self"
#    (no shared memory: no vader, no ucx), btl_tcp_if_include and oob_tcp_if_include 10.77.0.0/24,
#    so every byte between ranks crosses the shaped veth links. Checked on every run: each
#    rank reports its address (must be 10.77.0.(K+1)), and the eth0 receive counters of the
#    hosts (ip -n phx-K -s link) must have grown by at least the payload the collective has to
#    move, (N-1) x size per iteration; the bytes are noted in the raw file.
#    --mca mpi_yield_when_idle 1: the N ranks share this machine's cores, so a waiting rank
#    yields instead of spinning (what Open MPI does by itself when it knows a host is
#    oversubscribed; here each rank seems to have a host of its own).
# 3. Phalanx: cluster/run.sh CONFIG -- phalanx bench broadcast,reduce,allreduce,gather
#    --config CONFIG --size ... --iters N --warmup W --json (one run per distinct iters/warmup,
#    sizes largest first), CONFIG = cluster/examples/netns-8.toml (for N != 8 a copy with N nodes).
# 4. Prints a table per collective and size: Phalanx median (and p99 when the bench prints
#    p99_s), Open MPI's default median, the best median over its default and tuned
#    configurations and which one (with its p99), the ratio Phalanx / best, and for reference
#    the best Open MPI median by the OSU rule ("mpi span": the largest own t1 - t0 of a rank,
#    barrier skew left out), and the median barrier exit skew of each side (Phalanx's bench
#    barrier, MPI_Barrier of the best configuration; part of both times). The table goes to
#    FILE as JSON
#    lines (default cluster/results/compare-mpi-N-RATE.jsonl, replaced); every record of every
#    configuration goes to FILE's sibling *-raw.jsonl ("mpi_best": true marks the best), with "#"
#    notes (commands, machine load, link bytes).
#
# Timing (collbench, the rule of phalanx bench): per iteration MPI_Barrier, t0 = CLOCK_MONOTONIC
# on every rank as it leaves the barrier, the collective, t1 on every rank; on one kernel (the
# emulated hosts) every rank shares the clock and the iteration's time is the last t1 minus the
# first t0 (the barrier's exit skew counts, for both), else the largest t1 - t0 over
# the ranks; median, min, max, p99 over the timed iterations after the warm-up ones. "size" is
# the object per rank, as in phalanx bench: broadcast sends size bytes from rank 0, reduce and
# allreduce sum size/4 float32, gather collects size bytes from every rank at rank 0.
#
# Defaults: iters 20 below 16 MiB, 5 below 64 MiB, 3 from 64 MiB; warm-up 2 below 16 MiB, else
# 1 (one value, or one per size, overrides). Every mpirun and bench run is bounded by --timeout
# (default 600 s each); a run that fails is tried once more, then reported and skipped (the
# exit status is then 1). --wait-quiet P: before each run wait (at most 60 s, 5 minutes in all)
# until other work keeps the machine under P % busy (default 0: do not wait).
# --interval MS: an arrival pattern: after the barrier, rank K enters the collective (puts its
# input, for Phalanx) K x MS late, on both sides (collbench -i, phalanx bench
# --arrival-interval-ms); the table then compares the time from the last arrival to the last
# rank done ("after last": the iteration's time minus (N-1) x MS), and the default output
# file is compare-mpi-N-RATE-interval-MSms.jsonl.
# --inputs put|written: how Phalanx's inputs of reduce, allreduce and gather come to be in
# their ranks' stores (phalanx bench --inputs): put when due, inside the timing (default), or
# written in place before the barrier and sealed when due, as Open MPI's are in their buffers
# before its barrier. Written, the default output file ends in -written.jsonl.
# --nice N runs both sides under nice -n N (default 0; negative values put the measurement ahead
# of other work on a shared machine). Needs root (namespaces). Traffic stays on loopback and on
# the emulated subnet: the agent refuses any host outside it.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PREFIX=${PHX_PREFIX:-phx}
SUBNET=${PHX_SUBNET:-10.77.0}

# collective|name|MCA parameters (after --mca coll_tuned_use_dynamic_rules 1). Numbers are
# Open MPI 4.1's coll/tuned algorithm ids (ompi_info --param coll tuned --level 9). A forced
# algorithm gets no segmentation unless given a segment size, so the pipelined ones come with
# the sizes that did best in a sweep on the 8 hosts at 1 Gbit/s (64K..1M; 64K for 1 MiB
# objects, 256K-512K for 16 MiB; chain with fanout 4, knomial and the reduce+bcast allreduce
# never came close and are left out).
MPI_CONFIGS=(
    "broadcast|binomial|coll_tuned_bcast_algorithm 6"
    "broadcast|pipeline-64K|coll_tuned_bcast_algorithm 3 coll_tuned_bcast_algorithm_segmentsize 65536"
    "broadcast|pipeline-256K|coll_tuned_bcast_algorithm 3 coll_tuned_bcast_algorithm_segmentsize 262144"
    "broadcast|pipeline-1M|coll_tuned_bcast_algorithm 3 coll_tuned_bcast_algorithm_segmentsize 1048576"
    "broadcast|split-binary-256K|coll_tuned_bcast_algorithm 4 coll_tuned_bcast_algorithm_segmentsize 262144"
    "broadcast|scatter-allgather|coll_tuned_bcast_algorithm 8"
    "broadcast|scatter-allgather-ring|coll_tuned_bcast_algorithm 9"
    "reduce|binomial|coll_tuned_reduce_algorithm 5"
    "reduce|pipeline-64K|coll_tuned_reduce_algorithm 3 coll_tuned_reduce_algorithm_segmentsize 65536"
    "reduce|pipeline-256K|coll_tuned_reduce_algorithm 3 coll_tuned_reduce_algorithm_segmentsize 262144"
    "reduce|pipeline-1M|coll_tuned_reduce_algorithm 3 coll_tuned_reduce_algorithm_segmentsize 1048576"
    "reduce|binary-256K|coll_tuned_reduce_algorithm 4 coll_tuned_reduce_algorithm_segmentsize 262144"
    "reduce|in-order-binary-256K|coll_tuned_reduce_algorithm 6 coll_tuned_reduce_algorithm_segmentsize 262144"
    "reduce|rabenseifner|coll_tuned_reduce_algorithm 7"
    "allreduce|recursive-doubling|coll_tuned_allreduce_algorithm 3"
    "allreduce|ring|coll_tuned_allreduce_algorithm 4"
    "allreduce|segmented-ring-256K|coll_tuned_allreduce_algorithm 5 coll_tuned_allreduce_algorithm_segmentsize 262144"
    "allreduce|rabenseifner|coll_tuned_allreduce_algorithm 6"
    "gather|basic-linear|coll_tuned_gather_algorithm 1"
    "gather|binomial|coll_tuned_gather_algorithm 2"
    "gather|linear-sync|coll_tuned_gather_algorithm 3"
)

die() { echo "compare-mpi.sh: $*" >&2; exit 2; }
say() { echo "compare-mpi.sh: $*" >&2; }

sizes=1K,64K,1M,16M,64M iters="" warmup="" nodes=8 rate=1gbit bin=$ROOT/target/release/phalanx
out="" colls=broadcast,reduce,allreduce,gather nice_n=0 run_timeout=600 skip_mpi=0 skip_phalanx=0
quiet_pct=0 interval=0 inputs=put
while [ $# -gt 0 ]; do
    case $1 in
    --sizes) sizes=${2:?}; shift 2 ;;
    --iters) iters=${2:?}; shift 2 ;;
    --warmup) warmup=${2:?}; shift 2 ;;
    --nodes) nodes=${2:?}; shift 2 ;;
    --rate) rate=${2:?}; shift 2 ;;
    --phalanx-bin) bin=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --collectives) colls=${2:?}; shift 2 ;;
    --nice) nice_n=${2:?}; shift 2 ;;
    --timeout) run_timeout=${2:?}; shift 2 ;;
    --wait-quiet) quiet_pct=${2:?}; shift 2 ;;
    --skip-mpi) skip_mpi=1; shift ;;
    --interval) interval=${2:?}; shift 2 ;;
    --inputs) inputs=${2:?}; shift 2 ;;
    --skip-phalanx) skip_phalanx=1; shift ;;
    -h | --help) sed -n '2,/^set -euo pipefail/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
    esac
done

if ! [[ $nodes =~ ^[0-9]+$ ]] || [ "$nodes" -lt 2 ] || [ "$nodes" -gt 200 ]; then die "--nodes takes 2..200"; fi
[[ $nice_n =~ ^-?[0-9]+$ ]] || die "--nice takes a number"
[[ $quiet_pct =~ ^[0-9]+$ ]] || die "--wait-quiet takes a percentage"
if ! [[ $interval =~ ^[0-9]+$ ]] || [ "$interval" -gt 10000 ]; then die "--interval takes milliseconds (0..10000)"; fi
case $inputs in put | written) ;; *) die "--inputs takes put or written" ;; esac
if ! [[ $run_timeout =~ ^[0-9]+$ ]] || [ "$run_timeout" -lt 10 ]; then die "--timeout takes seconds (>= 10)"; fi
[ "$(id -u)" = 0 ] || die "must run as root (network namespaces)"
IFS=, read -r -a coll_list <<<"$colls"
for c in "${coll_list[@]}"; do
    case $c in broadcast | reduce | allreduce | gather) ;; *) die "unknown collective $c" ;; esac
done

# Sizes in bytes (K, M, G: powers of 1024, as phalanx bench), iterations and warm-up per size.
to_bytes() {
    local v=$1 m=1
    case ${v: -1} in k | K) m=1024 ;; m | M) m=1048576 ;; g | G) m=1073741824 ;; esac
    [ "$m" = 1 ] || v=${v%?}
    [[ $v =~ ^[0-9]+$ ]] || die "bad size $1"
    echo $((v * m))
}
IFS=, read -r -a size_list <<<"$sizes"
ns=${#size_list[@]}
[ "$ns" -ge 1 ] || die "no sizes"
declare -a size_b iters_l warm_l
for ((i = 0; i < ns; i++)); do
    size_b[i]=$(to_bytes "${size_list[i]}")
    [ "${size_b[i]}" -ge 4 ] || die "sizes must be at least 4 bytes (float32)"
done
per_size() { # per_size NAME VALUE MIN -> fills the array named NAME
    local -n arr=$1
    local v=$2 min=$3 parts i
    IFS=, read -r -a parts <<<"$v"
    [ ${#parts[@]} = 1 ] || [ ${#parts[@]} = "$ns" ] || die "--$1 takes one value or one per size"
    for ((i = 0; i < ns; i++)); do
        arr[i]=${parts[${#parts[@]} == 1 ? 0 : i]}
        if ! [[ ${arr[i]} =~ ^[0-9]+$ ]] || [ "${arr[i]}" -lt "$min" ]; then die "bad --$1 value ${arr[i]}"; fi
    done
}
if [ -n "$iters" ]; then per_size iters_l "$iters" 1; else
    for ((i = 0; i < ns; i++)); do
        if [ "${size_b[i]}" -lt $((16 << 20)) ]; then iters_l[i]=20
        elif [ "${size_b[i]}" -lt $((64 << 20)) ]; then iters_l[i]=5
        else iters_l[i]=3; fi
    done
fi
if [ -n "$warmup" ]; then per_size warm_l "$warmup" 0; else
    for ((i = 0; i < ns; i++)); do
        if [ "${size_b[i]}" -lt $((16 << 20)) ]; then warm_l[i]=2; else warm_l[i]=1; fi
    done
fi

written=""
[ "$inputs" = put ] || written=-written
if [ "$interval" = 0 ]; then
    out=${out:-$HERE/results/compare-mpi-$nodes-$rate$written.jsonl}
else
    out=${out:-$HERE/results/compare-mpi-$nodes-$rate-interval-${interval}ms$written.jsonl}
fi
raw=${out%.jsonl}-raw.jsonl
[ "$raw" != "$out" ] || raw=$out.raw.jsonl
mkdir -p "$(dirname "$out")"
case $bin in /*) ;; *) bin=$PWD/$bin ;; esac

# --- tools -----------------------------------------------------------------------------
need_pkgs=()
command -v mpirun >/dev/null || need_pkgs+=(openmpi-bin)
command -v mpicc >/dev/null || need_pkgs+=(libopenmpi-dev)
if [ $skip_mpi = 0 ] && [ ${#need_pkgs[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "missing packages: ${need_pkgs[*]} (install Open MPI)"
    say "installing ${need_pkgs[*]}"
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y "${need_pkgs[@]}" >&2 ||
        die "could not install ${need_pkgs[*]}; install them (apt-get install -y openmpi-bin libopenmpi-dev)"
fi
if [ $skip_phalanx = 0 ]; then
    [ -x "$bin" ] || die "no phalanx binary $bin (nice -n 10 cargo build --release -p phalanx-cli)"
fi
collbench=$ROOT/target/mpi/collbench
if [ $skip_mpi = 0 ]; then
    src=$HERE/mpi/collbench.c
    if [ ! -x "$collbench" ] || [ "$src" -nt "$collbench" ]; then
        mkdir -p "$(dirname "$collbench")"
        say "building $collbench"
        timeout 120 mpicc -O2 -Wall -Wextra -o "$collbench" "$src" -lm || die "mpicc failed"
    fi
fi

# --- hosts ------------------------------------------------------------------------------
work=$(mktemp -d /tmp/compare-mpi.XXXXXX)
made_hosts=0 child="" cleaned=0
host_ns() { echo "$PREFIX-$1"; }
host_ip() { echo "$SUBNET.$(($1 + 1))"; }
have_ns() { ip netns list | awk '{print $1}' | grep -qx -- "$1"; }
ns_pids() {
    local k
    for ((k = 0; k < nodes; k++)); do ip netns pids "$(host_ns "$k")" 2>/dev/null || true; done
}

# Our processes left on the hosts after a failed or killed run (orted daemonizes).
kill_leftovers() {
    local p left
    left=$(for p in $(ns_pids); do
        case $(cat "/proc/$p/comm" 2>/dev/null) in orted | collbench | mpirun | phalanx) echo "$p" ;; esac
    done)
    # shellcheck disable=SC2086 # a list of pids
    [ -z "$left" ] || kill -KILL $left 2>/dev/null || true
}

cleanup() {
    [ $cleaned = 1 ] && return
    cleaned=1
    if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
        # timeout(1) passes the signal on to the run it guards (mpirun or run.sh).
        kill -TERM "$child" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$child" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$child" 2>/dev/null || true
    fi
    kill_leftovers
    if [ $made_hosts = 1 ]; then
        timeout 120 "$HERE/netns.sh" down >/dev/null 2>&1 || say "netns.sh down failed; run it by hand"
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'say "interrupted; stopping"; exit 130' INT TERM HUP

all_exist=1
for ((k = 0; k < nodes; k++)); do have_ns "$(host_ns "$k")" || all_exist=0; done
if [ $all_exist = 1 ]; then
    busy=$(ns_pids | tr '\n' ' ')
    [ -z "${busy// /}" ] || die "the emulated hosts run other processes (pids $busy); wait for them or use other hosts"
    shaping=$(tc -n "$(host_ns 0)" class show dev eth0 classid 1:1 2>/dev/null | grep -o 'rate [^ ]*' | head -1)
    shaping=${shaping#rate }
    say "reusing the emulated hosts $(host_ns 0)..$(host_ns $((nodes - 1))) (shaped at ${shaping:-?})"
    [ "${shaping,,}" = "${rate,,}" ] ||
        say "warning: the hosts are shaped at ${shaping:-?}, not --rate $rate (netns.sh down to remake them)"
else
    say "making $nodes emulated hosts at $rate (removed again on exit)"
    made_hosts=1
    timeout 300 "$HERE/netns.sh" up "$nodes" --rate "$rate" >&2
fi

hostfile=$work/hostfile
for ((k = 0; k < nodes; k++)); do echo "$(host_ip "$k") slots=1"; done >"$hostfile"

if [ "$nodes" = 8 ]; then
    config=$HERE/examples/netns-8.toml
else
    config=$work/netns-$nodes.toml
    awk '/^[[:space:]]*\[\[nodes\]\]/ { exit } { print }' "$HERE/examples/netns-8.toml" >"$config"
    for ((k = 0; k < nodes; k++)); do
        printf '\n[[nodes]]\nid = %d\naddr = "%s:7100"\n' "$k" "$(host_ip "$k")" >>"$config"
    done
fi

# --- helpers ----------------------------------------------------------------------------
note() { echo "# $*" >>"$raw"; }
load() { cut -d' ' -f1-3 /proc/loadavg; }

# Sum over the hosts of eth0 received bytes, and of lo bytes.
link_bytes() {
    local k dev sum=0 v
    for dev in eth0 lo; do
        sum=0
        for ((k = 0; k < nodes; k++)); do
            v=$(ip -n "$(host_ns "$k")" -s link show dev "$dev" | awk '/RX:/ { getline; print $1; exit }')
            sum=$((sum + v))
        done
        printf '%s ' "$sum"
    done
}

# Runs "$@" under timeout in the background (so Ctrl-C reaches our trap), output to $1.
bounded() {
    local log=$1 rc=0
    shift
    timeout -k 15 "$run_timeout" "$@" >"$log" 2>&1 &
    child=$!
    wait "$child" || rc=$?
    child=""
    return $rc
}

nice_cmd=()
[ "$nice_n" = 0 ] || nice_cmd=(nice -n "$nice_n")

: >"$raw"
note "$(date -u +%FT%TZ) compare-mpi.sh: $nodes emulated hosts at $rate, sizes $sizes, iters ${iters_l[*]}, warmup ${warm_l[*]}, nice $nice_n; commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) cores, load $(load)"

mpi_args=(--allow-run-as-root -np "$nodes" --hostfile "$hostfile" --map-by node --bind-to none
    --mca plm_rsh_agent "$HERE/mpi/netns-agent.sh" --mca plm_rsh_no_tree_spawn 1
    --mca pml ob1 --mca btl "tcp,self"
    --mca btl_tcp_if_include "$SUBNET.0/24" --mca oob_tcp_if_include "$SUBNET.0/24"
    --mca mpi_yield_when_idle 1)
size_arg=$(IFS=,; echo "${size_list[*]}")
iters_arg=$(IFS=,; echo "${iters_l[*]}")
warm_arg=$(IFS=,; echo "${warm_l[*]}")

# Payload (bytes) a run of these collectives must at least move between hosts.
min_payload() {
    local c total=0 i
    for c in "$@"; do
        for ((i = 0; i < ns; i++)); do
            total=$((total + (nodes - 1) * size_b[i] * (iters_l[i] + warm_l[i])))
        done
    done
    echo $total
}

# shellcheck source=cluster/cpu.sh
. "$HERE/cpu.sh"

# With --wait-quiet P: wait (at most 60 s, 300 s over the whole run) until other work keeps
# the machine under P % busy.
waited=0 others=""
wait_quiet() {
    others=""
    [ "$quiet_pct" -gt 0 ] || return 0
    local b start=$SECONDS
    while :; do
        b=$(busy 2)
        others="; other work kept the machine ${b}% busy"
        [ "$b" -le "$quiet_pct" ] && break
        if [ $((SECONDS - start)) -ge 60 ] || [ $((waited + SECONDS - start)) -ge 300 ]; then
            note "machine still ${b}% busy with other work; measuring anyway"
            break
        fi
    done
    waited=$((waited + SECONDS - start))
}

# run_mpi LABEL COLLECTIVES MCA... (one retry when a run fails: a launch can fail for reasons
# of its own, and one lost configuration would leave a hole in the table)
failures=()
run_mpi() {
    local label=$1 cl=$2 log rc before after eth lo need t0 try
    shift 2
    log=$work/mpi-$label-${cl//,/_}.log
    local -a mca=()
    while [ $# -gt 1 ]; do mca+=(--mca "$1" "$2"); shift 2; done
    for try in 1 2; do
        wait_quiet
        read -r -a before <<<"$(link_bytes)"
        t0=$SECONDS rc=0
        note "load $(load)$others; mpirun ${mpi_args[*]} ${mca[*]} collbench -c $cl -s $size_arg -n $iters_arg -w $warm_arg -a $label -i $interval"
        # mpirun runs on host 0, named phx-0 like the daemons (see mpi/netns-agent.sh).
        # shellcheck disable=SC2016 # $@ is expanded by the inner shell
        bounded "$log" "${nice_cmd[@]}" ip netns exec "$(host_ns 0)" unshare --uts \
            sh -c 'hostname "$0" && exec "$@"' "$(host_ns 0)" mpirun "${mpi_args[@]}" "${mca[@]}" \
            "$collbench" -c "$cl" -s "$size_arg" -n "$iters_arg" -w "$warm_arg" -a "$label" -t tcp \
            -i "$interval" || rc=$?
        read -r -a after <<<"$(link_bytes)"
        [ $rc != 0 ] || break
        say "$label ($cl): failed (status $rc$([ $rc = 124 ] && echo ", timeout ${run_timeout}s")); last lines:"
        tail -n 8 "$log" >&2
        note "FAILED $label $cl status $rc (try $try)"
        kill_leftovers
    done
    if [ $rc != 0 ]; then
        failures+=("$label/$cl")
        return 0
    fi
    eth=$((after[0] - before[0])) lo=$((after[1] - before[1]))
    # Placement: rank K on host K.
    local k addr
    for ((k = 0; k < nodes; k++)); do
        addr=$(sed -n "s/^# rank $k: [^ ]* //p" "$log")
        [ "$addr" = "$(host_ip "$k")" ] || die "$label: rank $k ran behind '$addr', not $(host_ip "$k")"
    done
    IFS=, read -r -a cs <<<"$cl"
    need=$(min_payload "${cs[@]}")
    [ "$eth" -ge "$need" ] || die "$label: only $eth bytes crossed the links, less than the $need the collectives move"
    note "$label $cl: $((SECONDS - t0)) s; bytes received on the hosts' eth0: $eth (payload at least $need), on lo: $lo"
    grep '^{' "$log" >>"$raw" || true
    say "$label ($cl): $((SECONDS - t0)) s, $((eth >> 20)) MiB over the links (lo: $((lo >> 10)) KiB)"
}

# --- Open MPI ---------------------------------------------------------------------------
if [ $skip_mpi = 0 ]; then
    say "Open MPI: default decision, then $(for e in "${MPI_CONFIGS[@]}"; do
        c=${e%%|*}; [[ ,$colls, == *,$c,* ]] && echo x; done | wc -l) forced coll/tuned algorithms"
    run_mpi mpi-default "$colls"
    for e in "${MPI_CONFIGS[@]}"; do
        IFS='|' read -r c name params <<<"$e"
        [[ ,$colls, == *,$c,* ]] || continue
        # shellcheck disable=SC2086 # params is a list of MCA name/value pairs
        run_mpi "mpi-tuned-$name" "$c" coll_tuned_use_dynamic_rules 1 $params
    done
fi

# --- Phalanx ----------------------------------------------------------------------------
if [ $skip_phalanx = 0 ]; then
    # One bench run per distinct (iters, warmup), sizes largest first.
    mapfile -t groups < <(for ((i = 0; i < ns; i++)); do
        echo "${iters_l[i]} ${warm_l[i]} ${size_b[i]} ${size_list[i]}"; done |
        sort -k3,3nr | awk '{ k = $1 " " $2; if (!(k in s)) { o[++n] = k; s[k] = $4 } else s[k] = s[k] "," $4 }
            END { for (i = 1; i <= n; i++) print o[i], s[o[i]] }')
    for g in "${groups[@]}"; do
        read -r gi gw gs <<<"$g"
        log=$work/phalanx-$gi-$gw.log rc=0
        wait_quiet
        read -r -a before <<<"$(link_bytes)"
        t0=$SECONDS
        note "load $(load)$others; cluster/run.sh --timeout $run_timeout $config -- phalanx bench $colls --config $config --size $gs --iters $gi --warmup $gw --arrival-interval-ms $interval --inputs $inputs --json"
        run_nice=()
        [ "$nice_n" = 0 ] || run_nice=(--nice "$nice_n")
        bounded "$log" "$HERE/run.sh" --timeout "$run_timeout" "${run_nice[@]}" "$config" -- \
            "$bin" bench "$colls" --config "$config" --size "$gs" --iters "$gi" --warmup "$gw" \
            --arrival-interval-ms "$interval" --inputs "$inputs" --json || rc=$?
        read -r -a after <<<"$(link_bytes)"
        if [ $rc != 0 ]; then
            say "phalanx bench --size $gs: failed (status $rc); last lines:"
            tail -n 12 "$log" >&2
            note "FAILED phalanx $gs status $rc"
            kill_leftovers
            failures+=("phalanx/$gs")
            continue
        fi
        note "phalanx $gs: $((SECONDS - t0)) s; bytes received on the hosts' eth0: $((after[0] - before[0])), on lo: $((after[1] - before[1]))"
        grep '^{' "$log" >>"$raw" || true
        say "phalanx --size $gs: $((SECONDS - t0)) s, $(((after[0] - before[0]) >> 20)) MiB over the links"
    done
fi

# --- table ------------------------------------------------------------------------------
# Marks the best MPI record per collective and size, writes the comparison, prints the table.
tmp=$work/raw.jsonl
awk -v OUT="$out" -v TABLE="$work/table.txt" -v IV="$interval" -v COLLS="$colls" -v SIZES="$(IFS=,; echo "${size_b[*]}")" -v RATE="$rate" -v N="$nodes" '
function str(k,   m) { if (match(line, "\"" k "\":\"[^\"]*\"")) { m = substr(line, RSTART, RLENGTH); sub(/^"[^"]*":"/, "", m); sub(/"$/, "", m); return m } return "" }
function num(k,   m) { if (match(line, "\"" k "\":[-0-9.eE+]+")) { m = substr(line, RSTART, RLENGTH); sub(/^"[^"]*":/, "", m); return m } return "" }
function human(b) { if (b >= 1048576) return (b / 1048576) " MiB"; if (b >= 1024) return (b / 1024) " KiB"; return b " B" }
function ms(s) { if (s == "") return "-"; s *= 1000; return s >= 100 ? sprintf("%.0f", s) : (s >= 10 ? sprintf("%.1f", s) : (s >= 1 ? sprintf("%.2f", s) : sprintf("%.3f", s))) }
function jn(v) { return v == "" ? "null" : v }
# With an arrival pattern the compared time is from the last arrival to the last rank done.
function metric() { if (IV + 0 == 0) return num("median_s"); return str("algo") ~ /^mpi-/ ? num("after_last_median_s") : num("after_last_ready_s") }
{ lines[NR] = $0; line = $0 }
/^\{/ {
    c = str("collective"); a = str("algo"); sz = num("size_bytes"); med = metric()
    if (a ~ /^mpi-/) {
        k = c SUBSEP sz
        if (!(k in best) || med + 0 < bmed[k] + 0) { best[k] = NR; bmed[k] = med; bskew[k] = num("barrier_skew_median_s") }
        if (a == "mpi-default") dmed[k] = med
        own = num("median_own_span_s")
        if (own != "" && (!(k in bown) || own + 0 < bown[k] + 0)) bown[k] = own
    } else if (a == "phalanx") {
        pl[c SUBSEP sz] = NR
    }
}
END {
    for (i = 1; i <= NR; i++) {
        line = lines[i]
        if (line ~ /^\{/ && str("algo") ~ /^mpi-/) {
            k = str("collective") SUBSEP num("size_bytes")
            sub(/\}[[:space:]]*$/, ",\"mpi_best\":" (best[k] == i ? "true" : "false") "}", line)
        }
        print line
    }
    nc = split(COLLS, cs, ","); nsz = split(SIZES, ss, ",")
    if (IV + 0 > 0) printf "arrivals %s ms apart: \"phalanx ms\", \"mpi dflt ms\", \"mpi best ms\" and the ratio are from the last arrival to the last rank done (p99 and span: whole iterations)\n", IV > TABLE
    printf "\n%-10s %8s %11s %9s %11s %11s %9s  %-32s %7s %12s %13s\n", "collective", "size", "phalanx ms", "p99 ms", "mpi dflt ms", "mpi best ms", "p99 ms", "best Open MPI configuration", "ratio", "mpi span ms", "skew ms p/mpi" > TABLE
    printf "%s\n", "---------- -------- ----------- --------- ----------- ----------- ---------  -------------------------------- ------- ------------ -------------" > TABLE
    printf "" > OUT
    for (ci = 1; ci <= nc; ci++) for (si = 1; si <= nsz; si++) {
        c = cs[ci]; sz = ss[si]; k = c SUBSEP sz
        pmed = ""; pp99 = ""; pmin = ""; pmax = ""; pskew = ""; balgo = ""; bm = ""; bp99 = ""; ratio = ""
        if (k in pl) { line = lines[pl[k]]; pmed = metric(); pp99 = num("p99_s"); pmin = num("min_s"); pmax = num("max_s"); pskew = num("barrier_skew_s") }
        if (k in best) { line = lines[best[k]]; balgo = str("algo"); bm = metric(); bp99 = num("p99_s") }
        if (pmed != "" && bm != "" && bm + 0 > 0) ratio = sprintf("%.2f", pmed / bm)
        printf "%-10s %8s %11s %9s %11s %11s %9s  %-32s %7s %12s %13s\n", c, human(sz), ms(pmed), ms(pp99), ms(dmed[k]), ms(bm), ms(bp99), (balgo == "" ? "-" : balgo), (ratio == "" ? "-" : ratio "x"), ms(bown[k]), ms(pskew) "/" ms(bskew[k]) > TABLE
        printf "{\"collective\":\"%s\",\"size_bytes\":%d,\"nodes\":%d,\"transport\":\"tcp\",\"rate\":\"%s\",\"phalanx_median_s\":%s,\"phalanx_p99_s\":%s,\"phalanx_min_s\":%s,\"phalanx_max_s\":%s,\"mpi_default_median_s\":%s,\"mpi_best_algo\":%s,\"mpi_best_median_s\":%s,\"mpi_best_p99_s\":%s,\"ratio_phalanx_mpi\":%s,\"mpi_best_own_span_median_s\":%s,\"phalanx_barrier_skew_median_s\":%s,\"mpi_best_barrier_skew_median_s\":%s,\"arrival_interval_ms\":%d}\n", c, sz, N, RATE, jn(pmed), jn(pp99), jn(pmin), jn(pmax), jn(dmed[k]), (balgo == "" ? "null" : "\"" balgo "\""), jn(bm), jn(bp99), jn(ratio), jn(bown[k]), jn(pskew), jn(bskew[k]), IV > OUT
    }
}' "$raw" >"$tmp"
mv "$tmp" "$raw"
cat "$work/table.txt"
echo
say "table as JSON lines: $out; every configuration: $raw"
if [ ${#failures[@]} -gt 0 ]; then
    say "failed runs: ${failures[*]}"
    exit 1
fi
