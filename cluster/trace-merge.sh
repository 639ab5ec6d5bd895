#!/usr/bin/env bash
# Interleaves the hop traces of every rank of one `phalanx bench --trace` run (one process per
# node on one host, so every stamp is on the same monotonic clock) into one timeline:
#
#   cluster/run.sh --logs DIR CONFIG -- target/release/phalanx bench ... --trace 2> rank0.txt
#   cluster/trace-merge.sh rank0.txt DIR/rank-*.log
#
# Every line: microseconds since rank 0 left the barrier of the traced iteration, the gap to
# the line before, then the hop as the rank printed it. One block per traced size.
set -euo pipefail
(( $# >= 1 )) || { echo "usage: $0 RANK0_OUTPUT [RANK_LOG...]" >&2; exit 2; }
awk '
    FNR == 1 { block = 0 }
    /^# trace: / {
        block++
        if (FILENAME == ARGV[1]) { match($0, /start@[0-9]+/); start[block] = substr($0, RSTART + 6, RLENGTH - 6); title[block] = $0 }
        next
    }
    /^# .* @[0-9]+$/ && block > 0 {
        at = $NF; sub(/^@/, "", at)
        line = $0; sub(/^# +[-0-9.]+ +[-+0-9.]+ +/, "", line); sub(/ @[0-9]+$/, "", line)
        n++; blk[n] = block; t[n] = at; txt[n] = line
    }
    END {
        for (b = 1; b in start; b++) {
            print title[b]; fflush()
            m = 0
            for (i = 1; i <= n; i++) if (blk[i] == b) { m++; k[m] = t[i] "\t" txt[i] }
            cmd = "sort -n"
            for (i = 1; i <= m; i++) print k[i] | cmd
            close(cmd)
        }
    }
' "$@" | awk -F'\t' '
    /^# trace: / { print; match($0, /start@[0-9]+/); s = substr($0, RSTART + 6, RLENGTH - 6) + 0; prev = s; next }
    { printf "%10.1f %+9.1f  %s\n", ($1 - s) / 1e3, ($1 - prev) / 1e3, $2; prev = $1 }
'
