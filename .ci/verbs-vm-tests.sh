#!/usr/bin/env bash
# Runs every verbs test inside a Soft-RoCE VM (soft-roce-setup.sh vm): the verbs-layer unit
# and integration tests of phalanx-rdma, the transport contract suite on verbs, the
# store/broadcast/reduce tests on the verbs transport, `phalanx info` (rxe0 must be ACTIVE
# with its GIDs, and chosen) and the 4-node demo with --transport rdma. Test binaries and
# the phalanx binary are the default build made on the host (libibverbs loaded at run time).
# Prints the number of tests that passed; fails if any failed or was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

bins=$(cargo test --release -p phalanx-rdma -p phalanx --test verbs_cluster --lib --tests --no-run \
    --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*"' | cut -d'"' -f4)
pick() { grep "/$1-" <<<"$bins" | head -1 | sed "s|^$PWD/||"; }
unit=$(pick phalanx_rdma)
integ=$(pick verbs_transport)
contract=$(pick contract_verbs)
cluster=$(pick verbs_cluster)
for b in "$unit" "$integ" "$contract" "$cluster"; do
    [[ -n $b && -x $b ]] || { echo "verbs test binary missing ($b)" >&2; exit 1; }
done
cargo build --release -p phalanx-cli --bin phalanx
phalanx=${CARGO_TARGET_DIR:-target}/release/phalanx

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cmd="set -e
echo '== phalanx-rdma unit tests'; $unit --test-threads=1
echo '== verbs transport tests'; timeout 900 $integ --test-threads=1 --nocapture
echo '== transport contract on verbs'; timeout 900 $contract --test-threads=1
echo '== store and collectives on verbs'; timeout 900 $cluster --test-threads=1 --nocapture
echo '== phalanx info'; $phalanx info --transport rdma
echo '== demo, 4 nodes, verbs'; NO_COLOR=1 RUST_LOG=phalanx_rdma=info timeout 600 $phalanx demo --nodes 4 --size 16M --transport rdma"
status=0
bash soft-roce-setup.sh vm --timeout 2400 --mem 4096 -- sh -c "$cmd" 2>&1 | tee "$log" || status=$?

passed=$(grep -o 'test result: ok\. [0-9]* passed' "$log" | awk '{s += $4} END {print s + 0}')
# Counted from the harness's summary lines only (a test's own output may say "peer 1 failed");
# a binary that crashes or times out stops the VM's `set -e` script, caught by the status.
failed=$(grep -oE 'test result: [A-Za-z]+\. [0-9]+ passed; [0-9]+ failed' "$log" \
    | awk '{s += $6} END {print s + 0}')
skipped=$(grep -c 'no RDMA device: skipped' "$log" || true)
echo "verbs tests in the VM: $passed passed, $failed failed, $skipped skipped"
grep -q 'all 3 copies verified byte for byte' "$log" || { echo "verbs demo did not verify"; status=1; }
# phalanx info: rxe0 with port 1 ACTIVE and its GID table, and rxe0 chosen.
info_ok=1
grep -q 'rxe0: NUMA node' "$log" || info_ok=0
grep -q 'port 1: ACTIVE, link layer Ethernet' "$log" || info_ok=0
grep -qE 'GID\[ *[0-9]+\] .*RoCE v2' "$log" || info_ok=0
grep -q 'verbs: device rxe0 port 1, GID\[' "$log" || info_ok=0
if (( info_ok )); then
    echo "phalanx info in the VM: rxe0 ACTIVE, $(grep -cE '^ +GID\[ *[0-9]+\] ' "$log") GIDs listed, rxe0 chosen"
else
    echo "phalanx info did not show rxe0 ACTIVE with its GIDs"
    status=1
fi
if (( status != 0 || failed != 0 || skipped != 0 || passed == 0 )); then
    echo "verbs VM tests FAILED" >&2
    exit 1
fi
