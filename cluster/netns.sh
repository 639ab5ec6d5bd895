#!/usr/bin/env bash
# Emulated hosts on one machine: network namespaces joined by veth pairs to a bridge, each
# host's uplink and downlink shaped to a NIC-like rate with tc.
#
#   cluster/netns.sh up N [--rate R] [--delay D]   create hosts phx-0 .. phx-(N-1)
#                                                  (refused while a process runs on a host)
#   cluster/netns.sh down                          stop what runs on the hosts, then remove
#                                                  every namespace, veth, bridge and qdisc
#   cluster/netns.sh exec K CMD...                 run CMD on host K (env PHALANX_RANK=K)
#   cluster/netns.sh status                        list hosts, addresses and shaping
#
# Layout (nothing is created in the root namespace):
#
#   phx-K (host K)                        phx-br (the "switch")
#   eth0 10.77.0.(K+1)/24  <-- veth -->   hK  -- enslaved to -- br0
#   egress: uplink shaper                 egress of hK: downlink shaper of host K
#
# Each shaper is an htb tree: one class at the host's rate R, and under it one class per peer
# (guaranteed R/(N-1), may borrow up to R), so a host's bandwidth is shared fairly between the
# flows to (or from) its peers, as a NIC's fair queueing would; this gave steadier collective
# timings than a single FIFO token bucket. This kernel has htb and tbf but no netem, fq,
# fq_codel or sfq; --delay needs netem and fails with a message where it is missing.
#
# Addresses: one private /24 (default 10.77.0.0/24, set PHX_SUBNET=a.b.c to change) used only
# inside these namespaces. The root namespace gets no address or route into it.
set -Eeuo pipefail

PREFIX=${PHX_PREFIX:-phx}
SUBNET=${PHX_SUBNET:-10.77.0}
BRNS="$PREFIX-br"
MAX_HOSTS=200

die() { echo "netns.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "must run as root (network namespaces and tc)"; }
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

host_ns() { echo "$PREFIX-$1"; }
host_ip() { echo "$SUBNET.$(($1 + 1))"; }

# Existing host namespaces, by index, ascending.
hosts() {
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^$PREFIX-\([0-9][0-9]*\)\$/\1/p" | sort -n
}

# "1gbit", "500mbit", "1G", "2.5gbit", "100000kbit", "800000000" -> bits per second
rate_bits() {
    local r=${1,,} num unit mult
    [[ $r =~ ^([0-9]+(\.[0-9]+)?)([kmg]?)(bit|bps|b)?$ ]] || die "bad rate ${1:?} (try 1gbit, 500mbit)"
    num=${BASH_REMATCH[1]}; unit=${BASH_REMATCH[3]}
    [ "${BASH_REMATCH[4]}" = bps ] && die "give the rate in bits (1gbit), not bytes ($1)"
    case $unit in k) mult=1000 ;; m) mult=1000000 ;; g) mult=1000000000 ;; *) mult=1 ;; esac
    awk -v n="$num" -v m="$mult" 'BEGIN { printf "%.0f", n * m }'
}

# Parses "10ms", "1.5ms", "200us" -> checks the syntax only; tc parses it.
check_delay() {
    [[ $1 =~ ^[0-9]+(\.[0-9]+)?(s|ms|us|usec|msec)$ ]] || die "bad delay $1 (try 1ms, 200us)"
}

netem_available() {
    # Try a netem qdisc on a throwaway dummy device in a throwaway namespace.
    local ns="$PREFIX-probe-$$" ok=1
    ip netns add "$ns"
    if ip -n "$ns" link add probe0 type dummy 2>/dev/null &&
        tc -n "$ns" qdisc add dev probe0 root netem delay 1ms 2>/dev/null; then
        ok=0
    fi
    ip netns del "$ns"
    return $ok
}

# shape NS DEV MATCH(dst|src) SELF N RATE_BITS [DELAY]
# An htb tree on DEV's egress in namespace NS: class 1:1 at the host rate, one leaf per peer
# (selected by the peer's address as MATCH), and a default leaf for everything else (ARP).
shape() {
    local ns=$1 dev=$2 dir=$3 self=$4 n=$5 rate=$6 delay=${7:-}
    local per=$((rate / (n > 1 ? n - 1 : 1)))
    # Burst: about 1 ms at the rate, at least 32 KiB (a GSO packet may be 64 KiB; htb lets a
    # class overdraw, so this bounds how far the rate is exceeded in a burst, not the packet).
    local burst=$((rate / 8 / 1000)); [ "$burst" -lt 32768 ] && burst=32768
    local q=65536
    local t=(tc -n "$ns")
    "${t[@]}" qdisc add dev "$dev" root handle 1: htb default ffff
    "${t[@]}" class add dev "$dev" parent 1: classid 1:1 htb rate "${rate}bit" ceil "${rate}bit" \
        burst "$burst" cburst "$burst" quantum "$q"
    "${t[@]}" class add dev "$dev" parent 1:1 classid 1:ffff htb rate "$((per / 100 + 8000))bit" \
        ceil "${rate}bit" burst "$burst" cburst "$burst" quantum 1514
    local j cls
    for ((j = 0; j < n; j++)); do
        [ "$j" = "$self" ] && continue
        cls=$(printf '%x' $((j + 16)))
        "${t[@]}" class add dev "$dev" parent 1:1 classid "1:$cls" htb rate "${per}bit" \
            ceil "${rate}bit" burst "$burst" cburst "$burst" quantum "$q"
        if [ -n "$delay" ]; then
            "${t[@]}" qdisc add dev "$dev" parent "1:$cls" handle "$cls:" netem delay "$delay" limit 100000
        else
            "${t[@]}" qdisc add dev "$dev" parent "1:$cls" handle "$cls:" pfifo limit 1000
        fi
        "${t[@]}" filter add dev "$dev" parent 1: protocol ip prio 1 u32 \
            match ip "$dir" "$(host_ip "$j")/32" flowid "1:$cls"
    done
}

# IPv4 only: no router solicitations or MLD reports on the emulated links.
no_ipv6() {
    ip netns exec "$1" sh -c 'for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 \
        /proc/sys/net/ipv6/conf/default/disable_ipv6; do [ -w "$f" ] && echo 1 >"$f"; done; true'
}

cmd_up() {
    local n=${1:-} rate_s=1gbit delay=""
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le $MAX_HOSTS ] ||
        die "up needs a host count 1..$MAX_HOSTS (got '${n}')"
    shift
    while [ $# -gt 0 ]; do
        case $1 in
        --rate) rate_s=${2:?--rate needs a value}; shift 2 ;;
        --rate=*) rate_s=${1#*=}; shift ;;
        --delay) delay=${2:?--delay needs a value}; shift 2 ;;
        --delay=*) delay=${1#*=}; shift ;;
        *) die "unknown option $1" ;;
        esac
    done
    need_root
    local rate; rate=$(rate_bits "$rate_s")
    [ "$rate" -ge 8000 ] || die "rate $rate_s is too low"
    if [ -n "$delay" ]; then
        check_delay "$delay"
        netem_available || die "--delay needs the netem qdisc, which this kernel lacks \
(CONFIG_NET_SCH_NETEM is not set); run without --delay"
    fi
    if [ -n "$(hosts)" ] || ip netns list | grep -qw "^$BRNS"; then
        local busy; busy=$(host_pids)
        [ -z "$busy" ] || die "the emulated hosts are in use (pids $(echo $busy)); \
wait for those to end, or run 'netns.sh down' to stop them"
        echo "netns.sh: emulated hosts exist; removing them first" >&2
        cmd_down
    fi
    trap 'echo "netns.sh: up failed; cleaning up" >&2; cmd_down >/dev/null 2>&1 || true' ERR

    ip netns add "$BRNS"
    no_ipv6 "$BRNS"
    ip -n "$BRNS" link set lo up
    ip -n "$BRNS" link add br0 type bridge
    # No STP, no forwarding delay: a plain learning switch.
    ip -n "$BRNS" link set br0 type bridge stp_state 0 forward_delay 0
    ip -n "$BRNS" link set br0 up
    local k ns
    for ((k = 0; k < n; k++)); do
        ns=$(host_ns "$k")
        ip netns add "$ns"
        no_ipv6 "$ns"
        ip -n "$ns" link set lo up
        # Create the pair inside the bridge namespace, then move one end into the host.
        ip -n "$BRNS" link add "h$k" type veth peer name eth0 netns "$ns"
        ip -n "$BRNS" link set "h$k" master br0
        ip -n "$ns" link set eth0 mtu 1500
        ip -n "$BRNS" link set "h$k" mtu 1500
        ip -n "$ns" addr add "$(host_ip "$k")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$BRNS" link set "h$k" up
        shape "$ns" eth0 dst "$k" "$n" "$rate" "$delay"        # uplink: to each peer
        shape "$BRNS" "h$k" src "$k" "$n" "$rate" "$delay"     # downlink: from each peer
    done
    trap - ERR
    # Wait for the links (and the bridge) to forward.
    local tries
    if command -v ping >/dev/null; then
        for ((k = 1; k < n; k++)); do
            for ((tries = 0; tries < 50; tries++)); do
                ip netns exec "$(host_ns 0)" ping -c1 -W1 -q "$(host_ip "$k")" >/dev/null 2>&1 && break
                sleep 0.1
            done
        done
    else
        sleep 0.2
    fi
    echo "up: $n hosts $(host_ns 0)..$(host_ns $((n - 1))) at $(host_ip 0)..$(host_ip $((n - 1))), \
$rate_s ($rate bit/s) up and down per host${delay:+, $delay delay per direction}"
}

# Processes running inside any emulated host.
host_pids() {
    local k
    for k in $(hosts); do ip netns pids "$(host_ns "$k")" 2>/dev/null; done
    ip netns pids "$BRNS" 2>/dev/null || true
}

cmd_down() {
    need_root
    local k pids i
    # A process left in a namespace would keep it (and its veth and qdiscs) alive.
    pids=$(host_pids)
    if [ -n "$pids" ]; then
        echo "netns.sh: stopping processes on the emulated hosts: $(echo $pids)" >&2
        kill -TERM $pids 2>/dev/null || true
        for ((i = 0; i < 30; i++)); do
            [ -z "$(host_pids)" ] && break
            sleep 0.1
        done
        pids=$(host_pids)
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    fi
    for k in $(hosts); do
        ip netns del "$(host_ns "$k")" 2>/dev/null || true
    done
    if ip netns list | awk '{print $1}' | grep -qx "$BRNS"; then
        ip netns del "$BRNS" 2>/dev/null || true
    fi
    # Namespaces are freed asynchronously; wait until their veths are gone.
    local i
    for ((i = 0; i < 50; i++)); do
        [ -z "$(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-([0-9]+|br|probe-[0-9]+)\$")" ] && break
        sleep 0.1
    done
    # Leftovers of an interrupted run in the root namespace (we never create any, but a
    # half-moved veth would land here).
    local dev
    for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 |
        grep -E "^(h[0-9]+|$PREFIX-[a-z0-9-]+)\$" || true); do
        ip link del "$dev" 2>/dev/null || true
    done
    echo "down: no emulated hosts left"
}

cmd_exec() {
    local k=${1:-}
    [[ $k =~ ^[0-9]+$ ]] || die "exec needs a host index"
    shift
    [ $# -gt 0 ] || die "exec needs a command"
    need_root
    ip netns list | awk '{print $1}' | grep -qx "$(host_ns "$k")" || die "no host $k (run up first)"
    PHALANX_RANK=$k exec ip netns exec "$(host_ns "$k")" "$@"
}

cmd_status() {
    local k ns any=0
    for k in $(hosts); do
        any=1
        ns=$(host_ns "$k")
        printf '%s %s  up: %s  down: %s\n' "$ns" \
            "$(ip -n "$ns" -o -4 addr show dev eth0 2>/dev/null | awk '{print $4}')" \
            "$(tc -n "$ns" class show dev eth0 classid 1:1 2>/dev/null | grep -o 'rate [^ ]*' | head -1)" \
            "$(tc -n "$BRNS" class show dev "h$k" classid 1:1 2>/dev/null | grep -o 'rate [^ ]*' | head -1)"
    done
    [ $any = 1 ] || echo "no emulated hosts"
}

case ${1:-} in
up) shift; cmd_up "$@" ;;
down) shift; cmd_down ;;
exec) shift; cmd_exec "$@" ;;
status) shift; cmd_status ;;
-h | --help | help) usage 0 ;;
*) usage 2 ;;
esac
