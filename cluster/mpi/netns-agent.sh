#!/usr/bin/env bash
# Open MPI's rsh launcher agent for the emulated hosts of cluster/netns.sh: instead of ssh, it
# starts the command in the network namespace that owns the host's address.
#
#   netns-agent.sh HOST COMMAND...      (called by mpirun: --mca plm_rsh_agent netns-agent.sh)
#
# HOST is an address of the emulated subnet (default 10.77.0.0/24, PHX_SUBNET=a.b.c): host
# 10.77.0.(K+1) is namespace phx-K (PHX_PREFIX=phx). COMMAND is what mpirun would hand to a
# remote shell (the orted daemon and its arguments, quoted for a shell), so it is run by sh -c,
# as sshd would. Anything else is refused: this agent never reaches a real host.
set -euo pipefail

PREFIX=${PHX_PREFIX:-phx}
SUBNET=${PHX_SUBNET:-10.77.0}

die() { echo "netns-agent.sh: $*" >&2; exit 255; }

# ssh-style options that a launcher might put before the host are not expected; refuse them.
[ $# -ge 2 ] || die "usage: netns-agent.sh HOST COMMAND..."
host=$1
shift
[[ $host == "$SUBNET".* ]] || die "host $host is not an emulated host ($SUBNET.0/24)"
last=${host##*.}
if ! [[ $last =~ ^[0-9]+$ ]] || [ "$last" -lt 1 ]; then die "bad host address $host"; fi
ns="$PREFIX-$((last - 1))"
ip netns list | awk '{print $1}' | grep -qx -- "$ns" || die "no namespace $ns for $host (cluster/netns.sh up N)"
# shellcheck disable=SC2016 # $0 and $1 are expanded by the inner shell
exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$1" && exec /bin/sh -c "$0"' "$*" "$ns"
