#!/usr/bin/env bash
# Checks cluster/netns.sh: brings up 3 emulated hosts, checks addresses, connectivity and the
# shaping, runs a tiny job through run.sh, takes everything down and checks that no namespace,
# veth, bridge or qdisc is left behind. Exits non-zero on the first failure. Needs root;
# iperf3 (for the rate check) is optional: without it that check is skipped.
#
#   cluster/test-netns.sh            (about 15 s)
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NETNS=$HERE/netns.sh
RUN=$HERE/run.sh
PREFIX=${PHX_PREFIX:-phx}
SUBNET=${PHX_SUBNET:-10.77.0}
RATE_MBIT=200
passed=0 failed=0

ok() { echo "ok   $*"; passed=$((passed + 1)); }
bad() { echo "FAIL $*"; failed=$((failed + 1)); }
check() { # check DESCRIPTION COMMAND...
    local what=$1; shift
    if "$@" >/dev/null 2>&1; then ok "$what"; else bad "$what"; fi
}
finish() {
    "$NETNS" down >/dev/null 2>&1 || true
    echo "netns: $passed passed, $failed failed"
    [ "$failed" = 0 ]
    exit $?
}

if [ "$(id -u)" != 0 ]; then
    echo "test-netns.sh: needs root (network namespaces and tc)" >&2
    exit 1
fi
trap 'echo "interrupted"; failed=$((failed + 1)); finish' INT TERM

# What the machine had before, so the leak check compares like with like.
# Only names this tooling uses are compared, so other users of the machine do not disturb it.
ours() { ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^(h[0-9]+|br0|$PREFIX-.*)\$" | sort; }
links_before=$(ours)
qdiscs_before=$(tc qdisc show | grep -c htb || true)

if ! "$NETNS" up 3 --rate ${RATE_MBIT}mbit; then
    bad "netns.sh up 3"
    finish
fi
ok "netns.sh up 3 --rate ${RATE_MBIT}mbit"

for k in 0 1 2; do
    check "host $k has address $SUBNET.$((k + 1))" \
        sh -c "ip -n $PREFIX-$k -o -4 addr show dev eth0 | grep -q ' $SUBNET.$((k + 1))/24'"
    check "host $k uplink shaped with htb at ${RATE_MBIT}Mbit" \
        sh -c "tc -n $PREFIX-$k class show dev eth0 classid 1:1 | grep -q 'rate ${RATE_MBIT}Mbit'"
    check "host $k downlink shaped with htb at ${RATE_MBIT}Mbit" \
        sh -c "tc -n $PREFIX-br class show dev h$k classid 1:1 | grep -q 'rate ${RATE_MBIT}Mbit'"
    check "host $k has one class per peer on its uplink" \
        sh -c "[ \$(tc -n $PREFIX-$k class show dev eth0 | grep -c 'parent 1:1 leaf') = 2 ]"
done
check "the root namespace has no address in $SUBNET.0/24" \
    sh -c "! ip -o -4 addr show | grep -q ' $SUBNET\.'"
check "--delay fails with a clear message where netem is missing (or works)" \
    sh -c "out=\$('$NETNS' up 2 --delay 1ms 2>&1); rc=\$?; \
        if [ \$rc = 0 ]; then '$NETNS' up 3 --rate ${RATE_MBIT}mbit >/dev/null; \
        else echo \"\$out\" | grep -q netem && '$NETNS' status | grep -q $PREFIX-2; fi"

# iperf3 servers: one client each, bounded in time, in the foreground of a background job (a
# daemonised server would keep its namespace alive after down).
servers=()
serve() { # serve HOST PORT
    ip netns exec "$PREFIX-$1" timeout 30 iperf3 -s -1 -p "$2" >/dev/null 2>&1 &
    servers+=($!)
}
if command -v iperf3 >/dev/null; then
    # Connectivity: a TCP transfer between every pair.
    for k in 0 1 2; do serve "$k" 5201; done
    sleep 0.3
    for a in 0 1 2; do
        b=$(((a + 1) % 3))
        check "host $a reaches host $b over TCP" \
            ip netns exec "$PREFIX-$a" timeout 10 iperf3 -c "$SUBNET.$((b + 1))" -n 1M -p 5201
    done
    # Shaping: one flow's goodput within 85..100 % of the rate (TCP over Ethernet carries at
    # most 1448 payload bytes per 1514-byte frame: 95.6 %).
    serve 1 5202
    sleep 0.3
    mbit=$(ip netns exec "$PREFIX-0" timeout 20 iperf3 -c "$SUBNET.2" -p 5202 -t 3 -O 1 -J 2>/dev/null |
        awk -F'[:,]' '/"sum_received"/ { s = 1 } s && /"bits_per_second"/ { printf "%.0f", $2 / 1e6; exit }')
    if [ -n "$mbit" ] && [ "$mbit" -ge $((RATE_MBIT * 85 / 100)) ] && [ "$mbit" -le "$RATE_MBIT" ]; then
        ok "one flow gets $mbit Mbit/s of a ${RATE_MBIT} Mbit/s link"
    else
        bad "one flow gets '${mbit}' Mbit/s of a ${RATE_MBIT} Mbit/s link (want 85..100 %)"
    fi
    # Downlink: two senders into one host share its rate (sum stays within the rate).
    serve 2 5203
    serve 2 5204
    sleep 0.3
    tmp=$(mktemp -d)
    ip netns exec "$PREFIX-0" timeout 20 iperf3 -c "$SUBNET.3" -p 5203 -t 3 -O 1 -J >"$tmp/a" 2>/dev/null &
    c1=$!
    ip netns exec "$PREFIX-1" timeout 20 iperf3 -c "$SUBNET.3" -p 5204 -t 3 -O 1 -J >"$tmp/b" 2>/dev/null &
    c2=$!
    wait $c1 $c2
    sum=0
    for f in "$tmp/a" "$tmp/b"; do
        v=$(awk -F'[:,]' '/"sum_received"/ { s = 1 } s && /"bits_per_second"/ { printf "%.0f", $2 / 1e6; exit }' "$f")
        sum=$((sum + ${v:-0}))
    done
    rm -rf "$tmp"
    if [ "$sum" -ge $((RATE_MBIT * 80 / 100)) ] && [ "$sum" -le $((RATE_MBIT * 102 / 100)) ]; then
        ok "two senders into one host get $sum Mbit/s together (downlink ${RATE_MBIT} Mbit/s)"
    else
        bad "two senders into one host get $sum Mbit/s together (want 80..102 % of ${RATE_MBIT})"
    fi
    for p in "${servers[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
else
    echo "skip connectivity and rate checks: iperf3 is not installed"
fi

# run.sh: one command per node with its rank, rank 0's output printed, failures propagated.
cfg=$(mktemp /tmp/phx-test-XXXXXX.toml)
printf '[[nodes]]\nid = %d\naddr = "%s:7100"\n' 0 "$SUBNET.1" 1 "$SUBNET.2" 2 "$SUBNET.3" >"$cfg"
out=$("$RUN" --timeout 20 "$cfg" -- sh -c 'echo "rank $PHALANX_RANK on $(ip -o -4 addr show dev eth0 | awk "{print \$4}")"')
if [ "$out" = "rank 0 on $SUBNET.1/24" ]; then ok "run.sh runs rank 0 in host 0 and prints its output"
else bad "run.sh printed '$out'"; fi
"$RUN" --timeout 20 "$cfg" -- sh -c '[ "$PHALANX_RANK" != 2 ] || exit 3; sleep 30' >/dev/null 2>&1
rc=$?
if [ $rc = 3 ]; then ok "run.sh stops every rank when one fails and returns its status"
else bad "run.sh returned $rc when rank 2 failed (want 3)"; fi
t0=$SECONDS
"$RUN" --timeout 2 "$cfg" -- sleep 60 >/dev/null 2>&1
rc=$?
if [ $rc = 124 ] && [ $((SECONDS - t0)) -lt 10 ]; then ok "run.sh --timeout stops a hung job"
else bad "run.sh --timeout returned $rc after $((SECONDS - t0)) s"; fi
check "no rank is left running" sh -c "! pgrep -f '[s]leep 60' >/dev/null"
rm -f "$cfg"

# Down, and nothing left behind.
if "$NETNS" down >/dev/null; then ok "netns.sh down"; else bad "netns.sh down"; fi
check "no $PREFIX namespace is left" sh -c "! ip netns list | grep -q '^$PREFIX-'"
links_after=$(ours)
if [ "$links_before" = "$links_after" ]; then ok "no veth or bridge is left in the root namespace"
else bad "links left after down: $(comm -13 <(echo "$links_before") <(echo "$links_after") | tr '\n' ' ')"; fi
check "no veth whose peer was in an emulated host is left" \
    sh -c "! ip -o link show type veth | grep -Eq 'link-netns $PREFIX-|: (h[0-9]+|eth0)@'"
check "no bridge named br0 or $PREFIX-* is left" \
    sh -c "! ip -o link show type bridge | grep -Eq ': (br0|$PREFIX-[^:]*)[:@]'"
qdiscs_after=$(tc qdisc show | grep -c htb || true)
if [ "$qdiscs_before" = "$qdiscs_after" ]; then ok "no htb qdisc is left"
else bad "htb qdiscs: $qdiscs_before before, $qdiscs_after after"; fi
"$NETNS" down >/dev/null 2>&1 && ok "netns.sh down twice is harmless" || bad "netns.sh down twice"

finish
