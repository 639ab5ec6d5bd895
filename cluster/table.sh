#!/usr/bin/env bash
# Markdown table of a bench results file (JSON lines as `phalanx bench --json` prints them):
# median latency per collective, algorithm and size, and for the largest size the ratio to
# S/G, S the size and G the goodput of one host's link.
#
#   cluster/table.sh RESULTS [G_GBIT_S]
#
# G defaults to the last "# iperf3 goodput_gbit_s=..." note in RESULTS (cluster/bench-netns.sh
# writes it). Series are named as in the plots: star, phalanx, and phalanx d=K for reduce and
# allreduce at a forced degree; the last record of a series and size wins.
set -euo pipefail
[ $# -ge 1 ] && [ -r "$1" ] || { echo "usage: table.sh RESULTS [G_GBIT_S]" >&2; exit 2; }

awk -v G="${2:-}" '
function str(k,   m) { if (match($0, "\"" k "\":\"[^\"]*\"")) { m = substr($0, RSTART, RLENGTH); sub(/^"[^"]*":"/, "", m); sub(/"$/, "", m); return m } return "" }
function num(k,   m) { if (match($0, "\"" k "\":[-0-9.eE+]+")) { m = substr($0, RSTART, RLENGTH); sub(/^"[^"]*":/, "", m); return m } return "" }
function human(b) { if (b + 0 >= 1048576) return (b / 1048576) " MiB"; if (b + 0 >= 1024) return (b / 1024) " KiB"; return b " B" }
function ms(s) { s *= 1000; return s >= 100 ? sprintf("%.0f", s) : (s >= 10 ? sprintf("%.1f", s) : sprintf("%.2f", s)) }
/^# iperf3 goodput_gbit_s=/ { if (G == "") { g = $0; sub(/.*goodput_gbit_s=/, "", g); sub(/ .*/, "", g); lastG = g } next }
/^\{/ {
    c = str("collective"); a = str("algo"); sz = num("size_bytes"); med = num("median_s")
    iv = num("arrival_interval_ms"); if (iv != "" && iv != 0) next
    name = a
    if ((c == "reduce" || c == "allreduce") && a == "phalanx") {
        req = str("degree_requested"); d = num("degree")
        if (req == "auto") name = "phalanx"
        else if (req != "") name = "phalanx d=" req
        else if (d != "") name = "phalanx d=" d
    }
    key = c SUBSEP name
    if (!(key in seen)) { seen[key] = 1; order[++nk] = key }
    val[key, sz] = med
    if (!(sz in sizes)) { sizes[sz] = 1; ns++; sz_list[ns] = sz }
}
END {
    if (G == "") G = lastG
    # sizes ascending
    for (i = 1; i <= ns; i++) for (j = i + 1; j <= ns; j++) if (sz_list[j] + 0 < sz_list[i] + 0) { t = sz_list[i]; sz_list[i] = sz_list[j]; sz_list[j] = t }
    big = sz_list[ns]
    hdr = "| collective | algorithm |"; sep = "|---|---|"
    for (i = 1; i <= ns; i++) { hdr = hdr " " human(sz_list[i]) " |"; sep = sep "---:|" }
    if (G != "") { hdr = hdr " " human(big) " ÷ S/G |"; sep = sep "---:|" }
    print "median latency in ms" (G != "" ? sprintf("; G = %.3f Gbit/s, S/G for %s = %s ms", G, human(big), ms(big * 8 / (G * 1e9))) : "")
    print ""
    print hdr; print sep
    # broadcast, reduce, allreduce, then the rest; phalanx before the baselines
    split("broadcast reduce allreduce gather p2p", corder, " ")
    for (ci = 1; ci <= 5; ci++) for (pass = 1; pass <= 3; pass++) for (k = 1; k <= nk; k++) {
        split(order[k], p, SUBSEP)
        if (p[1] != corder[ci]) continue
        rank = (p[2] == "phalanx") ? 1 : (p[2] ~ /^phalanx/ ? 2 : 3)
        if (rank != pass) continue
        row = "| " p[1] " | " p[2] " |"
        for (i = 1; i <= ns; i++) row = row " " (((order[k], sz_list[i]) in val) ? ms(val[order[k], sz_list[i]]) : "–") " |"
        if (G != "") row = row " " (((order[k], big) in val) ? sprintf("%.2f", val[order[k], big] / (big * 8 / (G * 1e9))) : "–") " |"
        print row
    }
}' "$1"
