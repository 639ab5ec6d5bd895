#!/usr/bin/env bash
# Starts a command once per node of a Phalanx cluster and waits for all of them.
#
#   cluster/run.sh [OPTIONS] CONFIG -- CMD [ARGS...]
#
# Rank K (node id K of CONFIG) runs CMD with PHALANX_RANK=K set:
#   - emulated hosts (every node address is in the /24 of cluster/netns.sh, 10.77.0.0/24):
#     inside the namespace that owns the address, `ip netns exec phx-J CMD`. If the
#     namespaces do not exist yet, run.sh makes them (`netns.sh up N --rate R`) and removes
#     them again on exit;
#   - real hosts: over ssh to the node's address (or to --hosts), in the same directory.
# Rank 0's output is printed as it comes; the others' go to log files (shown when a rank
# fails). When any rank fails, or on Ctrl-C, or when --timeout expires, every rank is stopped.
# The exit status is the first failing rank's, else 0.
#
# Options:
#   --timeout S       stop everything after S seconds (default 3600)
#   --rate R          rate for namespaces run.sh makes itself (default 1gbit)
#   --mode M          netns, ssh or auto (default auto: netns when the addresses are local)
#   --hosts H0,H1,..  ssh destinations of ranks 0,1,... (default: the address in CONFIG)
#   --dir D           working directory on the ssh hosts (default: the current one)
#   --logs D          keep the ranks' logs in D (default: a temporary directory, removed)
#   --nice N          run every rank under `nice -n N` (negative: ahead of other work on a
#                     shared machine; needs root)
#
# Example (8 emulated hosts at 1 Gbit/s):
#   cluster/run.sh cluster/examples/netns-8.toml -- target/release/phalanx bench broadcast \
#       --config cluster/examples/netns-8.toml --size 1M,64M --iters 5 --json
#
# The cluster secret (README "Trust"): a CONFIG with `secret` or `secret_file` carries its
# own. Otherwise the ranks get PHALANX_SECRET: the caller's, or (netns mode) one made for this
# run. Over ssh the caller's PHALANX_SECRET is passed on the remote command line (visible in
# the remote host's process list: prefer `secret_file` on storage the hosts share).
#
# On a Slurm cluster no launcher script is needed: the bench takes its rank from SLURM_PROCID.
# Write a config whose node K is the K-th host of the allocation (cluster/slurm-config.sh does
# that) and start one task per node:
#   cluster/slurm-config.sh > cluster.toml
#   srun --nodes=8 --ntasks-per-node=1 target/release/phalanx bench broadcast --config cluster.toml
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PREFIX=${PHX_PREFIX:-phx}
SUBNET=${PHX_SUBNET:-10.77.0}

die() { echo "run.sh: $*" >&2; exit 2; }

timeout_s=3600 rate=1gbit mode=auto hosts_opt="" rdir=$PWD logs="" nice_n=""
while [ $# -gt 0 ]; do
    case $1 in
    --timeout) timeout_s=${2:?}; shift 2 ;;
    --rate) rate=${2:?}; shift 2 ;;
    --mode) mode=${2:?}; shift 2 ;;
    --hosts) hosts_opt=${2:?}; shift 2 ;;
    --dir) rdir=${2:?}; shift 2 ;;
    --logs) logs=${2:?}; shift 2 ;;
    --nice) nice_n=${2:?}; shift 2 ;;
    -h | --help) sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) die "give the CONFIG before --" ;;
    -*) die "unknown option $1" ;;
    *) break ;;
    esac
done
[ $# -ge 3 ] && [ "$2" = -- ] || die "usage: run.sh [OPTIONS] CONFIG -- CMD [ARGS...]"
config=$1
shift 2
if [ -n "$nice_n" ]; then
    [[ $nice_n =~ ^-?[0-9]+$ ]] || die "--nice takes a number"
    set -- nice -n "$nice_n" "$@"
fi
[ -r "$config" ] || die "cannot read $config"
[[ $timeout_s =~ ^[0-9]+$ ]] || die "--timeout takes whole seconds"

# Node addresses in id order: "id host port" per line.
mapfile -t nodes < <(awk '
    /^[[:space:]]*\[\[nodes\]\]/ { if (inb) print id, addr; inb = 1; id = ""; addr = ""; next }
    /^[[:space:]]*\[/ { if (inb) print id, addr; inb = 0; next }
    inb && /^[[:space:]]*id[[:space:]]*=/ { v = $0; sub(/^[^=]*=[[:space:]]*/, "", v); sub(/[[:space:]#].*/, "", v); id = v }
    inb && /^[[:space:]]*addr[[:space:]]*=/ { v = $0; sub(/^[^"]*"/, "", v); sub(/".*/, "", v); addr = v }
    END { if (inb) print id, addr }' "$config" | sort -n |
    awk '{ a = $2; p = a; sub(/:[0-9]+$/, "", a); sub(/.*:/, "", p); gsub(/[][]/, "", a); print $1, a, p }')
n=${#nodes[@]}
[ "$n" -ge 1 ] || die "no [[nodes]] in $config"
for ((k = 0; k < n; k++)); do
    read -r id _ _ <<<"${nodes[k]}"
    [ "$id" = "$k" ] || die "$config: node ids must be 0..$((n - 1)) (found id $id at position $k)"
done

local_addrs=1
for line in "${nodes[@]}"; do
    read -r _ host _ <<<"$line"
    [[ $host == "$SUBNET".* ]] || local_addrs=0
done
if [ "$mode" = auto ]; then
    mode=$([ $local_addrs = 1 ] && echo netns || echo ssh)
fi
case $mode in
netns) [ $local_addrs = 1 ] || die "netns mode needs every address in $SUBNET.0/24" ;;
ssh) ;;
*) die "--mode must be netns, ssh or auto" ;;
esac

IFS=, read -r -a ssh_hosts <<<"$hosts_opt"
if [ -n "$hosts_opt" ] && [ ${#ssh_hosts[@]} -ne "$n" ]; then
    die "--hosts lists ${#ssh_hosts[@]} hosts for $n nodes"
fi

if ! grep -Eq '^[[:space:]]*(secret|secret_file)[[:space:]]*=' "$config"; then
    if [ -z "${PHALANX_SECRET:-}" ] && [ "$mode" = netns ]; then
        PHALANX_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    fi
    if [ -n "${PHALANX_SECRET:-}" ]; then export PHALANX_SECRET; fi
fi

made_netns=0
own_logs=0
if [ -z "$logs" ]; then
    logs=$(mktemp -d /tmp/phalanx-run.XXXXXX)
    own_logs=1
fi
mkdir -p "$logs"
pids=()
cleaned=0

stop_all() {
    local p alive i
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for ((i = 0; i < 30; i++)); do
        alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}

cleanup() {
    [ $cleaned = 1 ] && return
    cleaned=1
    stop_all
    if [ $made_netns = 1 ]; then "$HERE/netns.sh" down >/dev/null || true; fi
    rm -f "$logs/.stdin"
    if [ $own_logs = 1 ]; then rm -rf "$logs"; fi
}
trap cleanup EXIT
trap 'echo "run.sh: interrupted; stopping every rank" >&2; exit 130' INT TERM HUP

if [ "$mode" = netns ]; then
    [ "$(id -u)" = 0 ] || die "netns mode must run as root"
    missing=0
    for line in "${nodes[@]}"; do
        read -r _ host _ <<<"$line"
        ns="$PREFIX-$((${host##*.} - 1))"
        ip netns list | awk '{print $1}' | grep -qx "$ns" || missing=1
    done
    if [ $missing = 1 ]; then
        max=0
        for line in "${nodes[@]}"; do
            read -r _ host _ <<<"$line"
            [ "${host##*.}" -gt $max ] && max=${host##*.}
        done
        echo "run.sh: making $max emulated hosts at $rate (removed again on exit)" >&2
        made_netns=1
        "$HERE/netns.sh" up "$max" --rate "$rate" >&2
    fi
fi

start_rank() {
    local k=$1 host=$2 out=$3
    shift 3
    if [ "$mode" = netns ]; then
        local ns="$PREFIX-$((${host##*.} - 1))"
        # ip netns exec execs CMD, so the pid we keep is CMD's own.
        if [ "$out" = - ]; then
            PHALANX_RANK=$k ip netns exec "$ns" "$@" </dev/null &
        else
            PHALANX_RANK=$k ip netns exec "$ns" "$@" >"$out" 2>&1 </dev/null &
        fi
    else
        local dest=${ssh_hosts[k]:-$host} q remote
        q=$(printf '%q ' "$@")
        # The remote side runs CMD in the background and kills it when its stdin (our fd 3,
        # which never delivers data) closes, i.e. when this ssh is killed or loses its link.
        local env=""
        if [ -n "${PHALANX_SECRET:-}" ]; then
            env="PHALANX_SECRET=$(printf '%q' "$PHALANX_SECRET") "
        fi
        remote="cd $(printf '%q' "$rdir") || exit 1
exec 3<&0
${env}PHALANX_RANK=$k $q </dev/null &
p=\$!
(cat <&3 >/dev/null; kill -TERM \$p 2>/dev/null) &
w=\$!
wait \$p; rc=\$?
kill \$w 2>/dev/null
exit \$rc"
        if [ "$out" = - ]; then
            ssh -o BatchMode=yes -o ConnectTimeout=10 "$dest" "$remote" <&3 &
        else
            ssh -o BatchMode=yes -o ConnectTimeout=10 "$dest" "$remote" >"$out" 2>&1 <&3 &
        fi
    fi
    pids[k]=$!
}

if [ "$mode" = ssh ]; then
    mkfifo "$logs/.stdin"
    exec 3<>"$logs/.stdin"
fi
start=$SECONDS
for ((k = n - 1; k >= 0; k--)); do
    read -r _ host _ <<<"${nodes[k]}"
    if [ "$k" = 0 ]; then
        start_rank 0 "$host" - "$@"
    else
        start_rank "$k" "$host" "$logs/rank-$k.log" "$@"
    fi
done

status=0 failed="" done_ranks=0
declare -A finished
while [ $done_ranks -lt "$n" ]; do
    for ((k = 0; k < n; k++)); do
        [ -n "${finished[$k]:-}" ] && continue
        if ! kill -0 "${pids[k]}" 2>/dev/null; then
            rc=0
            wait "${pids[k]}" || rc=$?
            finished[$k]=$rc
            done_ranks=$((done_ranks + 1))
            if [ $rc -ne 0 ] && [ -z "$failed" ]; then
                failed=$k status=$rc
                echo "run.sh: rank $k exited with status $rc; stopping the others" >&2
                break 2
            fi
        fi
    done
    if [ $((SECONDS - start)) -ge "$timeout_s" ]; then
        echo "run.sh: timeout after ${timeout_s}s; stopping every rank" >&2
        status=124
        break
    fi
    # Rank 0 is done and reported; the others get a grace period to leave on their own.
    if [ "${finished[0]:-x}" = 0 ] && [ -z "${grace:-}" ]; then grace=$((SECONDS + 20)); fi
    if [ -n "${grace:-}" ] && [ $SECONDS -ge "$grace" ] && [ $done_ranks -lt "$n" ]; then
        echo "run.sh: rank 0 finished but some ranks did not exit; stopping them" >&2
        break
    fi
    sleep 0.2
done

if [ $status -ne 0 ]; then
    for ((k = 1; k < n; k++)); do
        [ -s "$logs/rank-$k.log" ] || continue
        echo "--- rank $k (last lines of $logs/rank-$k.log) ---" >&2
        tail -n 15 "$logs/rank-$k.log" >&2
    done
fi
exit $status
