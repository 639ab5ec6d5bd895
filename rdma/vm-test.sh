#!/usr/bin/env bash
# Runs the phalanx-rdma tests inside the Soft-RoCE VM (see README.md).
#   bash rdma/vm-test.sh            build on the host, run unit, integration and contract tests
#                                   in the VM
#   bash rdma/vm-test.sh --bench    also the threshold sweep and ib_write_bw for comparison
# Run from the workspace root. Exit status: that of the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=0
[[ ${1:-} == --bench ]] && bench=1
out=$(cargo test -p phalanx-rdma --no-run --message-format=json 2>/dev/null |
    grep -o '"executable":"[^"]*"' | cut -d'"' -f4)
unit=$(grep '/phalanx_rdma-' <<<"$out" | head -1)
integ=$(grep '/verbs_transport-' <<<"$out" | head -1)
contract=$(grep '/contract_verbs-' <<<"$out" | head -1)
[[ -x $unit && -x $integ && -x $contract ]] || { echo "test binaries not found" >&2; exit 1; }
unit=${unit#"$PWD/"}
integ=${integ#"$PWD/"}
contract=${contract#"$PWD/"}
cmd="set -e; echo '== unit tests'; $unit --test-threads=1; echo '== verbs transport tests'; timeout 900 $integ --test-threads=1 --nocapture; echo '== transport contract'; timeout 900 $contract --test-threads=1"
if (( bench )); then
    cmd+="; echo '== threshold sweep'; timeout 600 $integ --ignored threshold_sweep --nocapture"
    cmd+="; echo '== ib_write_bw 64 MiB'; (ib_write_bw -d rxe0 -x \${PHALANX_RXE_GID_INDEX:-1} -s 67108864 -n 5 -F >/tmp/bw.srv 2>&1 &) ; sleep 2; timeout 300 ib_write_bw -d rxe0 -x \${PHALANX_RXE_GID_INDEX:-1} -s 67108864 -n 5 -F 10.181.0.1 || true"
fi
# Run a snapshot of the VM script: bash reads scripts as it goes, and others may edit it.
snap=$(mktemp /tmp/soft-roce-setup.XXXXXX.sh)
cp soft-roce-setup.sh "$snap"
trap 'rm -f "$snap"' EXIT
bash "$snap" vm --env RUST_LOG -- sh -c "$cmd"
