# Sourced by the cluster scripts: how busy this machine is.

# CPU busy (%) of the whole machine over the next $1 seconds.
busy() {
    local u n s i w q sq st b0 t0 b1 t1
    read -r _ u n s i w q sq st _ </proc/stat; b0=$((u + n + s + q + sq + st)); t0=$((b0 + i + w))
    sleep "$1"
    read -r _ u n s i w q sq st _ </proc/stat; b1=$((u + n + s + q + sq + st)); t1=$((b1 + i + w))
    echo $((100 * (b1 - b0) / (t1 - t0 > 0 ? t1 - t0 : 1)))
}
