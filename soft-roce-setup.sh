#!/usr/bin/env bash
# soft-roce-setup.sh - bring up a Soft-RoCE (rdma_rxe) device for Phalanx's
# RDMA verbs transport tests, either on this host or inside a throw-away QEMU
# VM for kernels that have no RDMA support.
#
# Run `soft-roce-setup.sh --help` for the usage.  Overview of the modes:
#
#   host [NETDEV]   Load rdma_rxe/ib_uverbs/rdma_ucm and create an rxe device on
#                   NETDEV (idempotent).  Without NETDEV a veth pair
#                   rxenet0/rxenet1 with 10.181.0.1/24 on rxenet0 is used (the
#                   same topology as inside the VM, so tests can always connect
#                   to 10.181.0.1).
#   vm -- CMD...    Boot a QEMU VM (TCG) whose root file system is the host's /
#                   (read-only 9p + tmpfs overlay) with the current directory
#                   shared read-write at the same path, set up rxe0 on rxenet0
#                   (10.181.0.1), run CMD there and exit with CMD's status.
#   deps            apt-get install everything the two modes and the verbs
#                   layout check need (Debian/Ubuntu).
#   packages        Print that package list.
#
# Internal mode (run by the VM itself, not by people): __guest CTLDIR.
#
# Exit codes of `vm`: CMD's own status; 124 when the VM ran longer than
# --timeout (qemu is killed); 125 when the VM could not be set up (no kernel
# with rdma_rxe, qemu failed, rxe0 did not become ACTIVE, ...).

set -euo pipefail

PROG=${0##*/}
SELF=$(readlink -f -- "${BASH_SOURCE[0]}")

# --- Constants shared by host mode and the guest -----------------------------
readonly VETH0=rxenet0 VETH1=rxenet1
readonly VETH_ADDR=10.181.0.1 VETH_PREFIX=24
readonly DEFAULT_DEV=rxe0
# 9p mount tags (at most 31 characters) used between qemu and the guest.
readonly TAG_ROOT=hostroot TAG_CWD=hostcwd TAG_CTL=phalanxctl
# Name of the virtio serial port (and of its /dev link in the guest) that
# carries CMD's stdout and stderr to this script's stdout.
readonly OUT_PORT=phalanx-out
# Where the control share appears inside the guest.
readonly GUEST_CTL=/run/phalanx-vm
# Bump when the initramfs layout changes in a way the content hash below would
# not notice (the /init text and module list are hashed already).
readonly INITRAMFS_FORMAT=1

# Debian packages: qemu + a kernel whose module tree has rdma_rxe.ko + the
# initramfs tools + the RDMA user space and test tools + what the verbs layout
# check builds against (verbs.h, libclang for rdma-sys's bindgen; the default
# Rust build needs none of these: libibverbs is loaded at run time).
readonly DEB_PACKAGES=(
    qemu-system-x86 linux-image-amd64 busybox-static cpio kmod iproute2
    rdma-core ibverbs-providers ibverbs-utils rdmacm-utils perftest
    libibverbs-dev librdmacm-dev libclang-dev
)

# Environment variables handed to CMD inside the VM (in addition to --env).
# Exact names, then prefixes (a trailing *).
readonly PASS_ENV=(
    PATH HOME USER LANG LC_ALL TERM NO_COLOR
    'RUST_*' 'PHALANX_*' 'CARGO_*' 'NEXTEST_*'
)

usage() {
    cat <<EOF
Usage:
  $PROG [host] [--name DEV] [--wait SECS] [NETDEV]
  $PROG vm [--timeout SECS] [--mem MB] [--smp N] [--kernel VER]
           [--accel tcg|kvm] [--env NAME[=VALUE]]... [--rebuild] [--verbose]
           -- CMD [ARGS...]
  $PROG deps
  $PROG packages
  $PROG --help

host (default mode)
  Needs root and a kernel with rdma_rxe.  Loads rdma_rxe, ib_uverbs and
  rdma_ucm and creates the rxe device DEV (default $DEFAULT_DEV) on NETDEV.
  If an rxe device already exists on NETDEV nothing is changed (exit 0).
  Without NETDEV a veth pair $VETH0/$VETH1 is created (if missing) with
  $VETH_ADDR/$VETH_PREFIX on $VETH0, and $VETH0 is used.  Then waits up to
  --wait seconds (default 30) for ports/1/state to be ACTIVE.

vm
  For kernels without RDMA support: boots a throw-away QEMU VM (TCG by
  default; /dev/kvm is not reliable on the CI machines) using the newest
  installed kernel whose /lib/modules/VER has rdma_rxe.ko.  The guest's root
  file system is the host's / (read-only, with a tmpfs overlay, so writes
  outside the current directory vanish); the current directory is shared
  read-write at the same path and is CMD's working directory, so binaries
  built on the host (e.g. target/debug/deps/...) run in the guest and their
  output files come back.  In the guest: $VETH0 ($VETH_ADDR/$VETH_PREFIX) <->
  $VETH1 veth pair, $DEFAULT_DEV on $VETH0 (ACTIVE), ulimit -l unlimited;
  client and server both use $DEFAULT_DEV and connect to $VETH_ADDR.
  CMD also gets PHALANX_RXE_DEV, PHALANX_RXE_ADDR, PHALANX_RXE_NETDEV and
  PHALANX_RXE_GID_INDEX (index of the IPv4-mapped RoCEv2 GID).
  Passed through from the host environment: ${PASS_ENV[*]}.
  CMD's stdout and stderr both go to this script's stdout (a virtio serial
  port, so not a tty in the guest), followed by a line
  "phalanx-vm: exit status N" (also printed for 124 and 125).  The guest's
  serial console (kernel messages, setup errors) goes to stderr: all of it
  when the VM failed or timed out, or with --verbose; otherwise only lines
  that are not routine (e.g. kernel errors).
  Exit status: CMD's status, 124 if the VM ran longer than --timeout (qemu
  is killed), 125 if the VM could not be set up.

  --timeout SECS  wall-clock limit for the whole VM run (default 1200,
                  env PHALANX_VM_TIMEOUT)
  --mem MB        guest memory (default 4096, env PHALANX_VM_MEM)
  --smp N         guest CPUs (default: host CPUs, at most 4; env PHALANX_VM_SMP)
  --kernel VER    use /boot/vmlinuz-VER and /lib/modules/VER
  --accel A       qemu accelerator, tcg (default) or kvm (env PHALANX_VM_ACCEL)
  --env N[=V]     pass variable N (with value V, or the host's value)
  --rebuild       rebuild the cached initramfs
  --verbose       show the whole guest console (kernel boot messages, rxe0's
                  GID table) on stderr, and the qemu command line

  The initramfs (and the kernel, uncompressed for a faster boot) are cached
  in \${XDG_CACHE_HOME:-\$HOME/.cache}/phalanx-vm/ (PHALANX_VM_CACHE
  overrides), keyed by kernel version and rebuilt when missing or stale.

  Example (as a cargo runner):
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="\$PWD/$PROG vm --" cargo test

deps
  apt-get update, then installs (no recommends): ${DEB_PACKAGES[*]}
EOF
}

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
# Exit status of die: 1, but 125 in vm mode (the VM could not be set up).
DIE_STATUS=1
die() { log "error: $*"; exit "$DIE_STATUS"; }

# ============================================================================
# host mode: create an rxe device on a kernel that has rdma_rxe
# ============================================================================

# Print the name of the rxe/RDMA device bound to netdev $1 (empty if none).
# `rdma link show` prints lines like
#   link rxe0/1 state ACTIVE physical_state LINK_UP netdev rxenet0
rdma_dev_on_netdev() {
    local links
    links=$(rdma link show 2>/dev/null || true)
    awk -v nd="$1" '
        !found { for (i = 1; i < NF; i++) if ($i == "netdev" && $(i + 1) == nd) {
                     split($2, a, "/"); print a[1]; found = 1; break } }' <<<"$links"
}

# Create the veth pair rxenet0/rxenet1 with 10.181.0.1/24 on rxenet0 and bring
# both ends up (the rxe port is ACTIVE only while the netdev has carrier, and
# a veth has carrier only when both ends are up).  Idempotent.
ensure_veth() {
    if ! ip link show dev "$VETH0" >/dev/null 2>&1; then
        modprobe veth 2>/dev/null || true   # may be built in
        ip link add "$VETH0" type veth peer name "$VETH1"
    fi
    local addrs
    addrs=$(ip -4 -o addr show dev "$VETH0")
    if [[ $addrs != *" $VETH_ADDR/"* ]]; then
        ip addr add "$VETH_ADDR/$VETH_PREFIX" dev "$VETH0"
    fi
    ip link set dev "$VETH0" up
    ip link set dev "$VETH1" up
}

# Wait until /sys/class/infiniband/$1/ports/1/state says ACTIVE, at most $2 s.
wait_active() {
    local dev=$1 secs=$2 state_file=/sys/class/infiniband/$1/ports/1/state
    local tries=$((secs * 10)) state=''
    while ((tries-- > 0)); do
        state=''
        read -r state <"$state_file" 2>/dev/null || true
        [[ $state == *ACTIVE* ]] && return 0
        sleep 0.1
    done
    log "$dev port 1 did not become ACTIVE within ${secs}s (state: ${state:-missing})"
    return 1
}

# Print the GID table of port 1 of device $1 like rdma-core's show_gids
# (device, index, GID, type, netdev; tab separated), from sysfs.  Unused
# entries are skipped.  Only shell builtins in the loop: rxe has 1024 GID
# entries, and a fork per entry costs minutes in a TCG guest.
print_gids() {
    local dev=$1 d=/sys/class/infiniband/$1/ports/1 i gid type ndev
    for ((i = 0; ; i++)); do
        [[ -e $d/gids/$i ]] || break
        read -r gid <"$d/gids/$i" 2>/dev/null || continue
        [[ $gid == 0000:0000:0000:0000:0000:0000:0000:0000 ]] && continue
        read -r type <"$d/gid_attrs/types/$i" 2>/dev/null || type='?'
        read -r ndev <"$d/gid_attrs/ndevs/$i" 2>/dev/null || ndev='?'
        printf '%s\t%s\t%s\t%s\t%s\n' "$dev" "$i" "$gid" "$type" "$ndev"
    done
}

# Print the index of the first RoCEv2 GID of device $1 that is an IPv4-mapped
# address (::ffff:a.b.c.d, in sysfs 0000:0000:0000:0000:0000:ffff:xxxx:xxxx).
# Empty if none.  The table fills from index 0, so stop at the first unused
# entry.
ipv4_gid_index() {
    local d=/sys/class/infiniband/$1/ports/1 i gid type
    for ((i = 0; ; i++)); do
        read -r gid <"$d/gids/$i" 2>/dev/null || return 0
        [[ $gid == 0000:0000:0000:0000:0000:0000:0000:0000 ]] && return 0
        [[ $gid == 0000:0000:0000:0000:0000:ffff:* ]] || continue
        read -r type <"$d/gid_attrs/types/$i" 2>/dev/null || type=''
        [[ $type == *v2* ]] || continue
        printf '%s\n' "$i"
        return 0
    done
}

host_mode() {
    local name=$DEFAULT_DEV netdev='' wait_secs=30
    while (($#)); do
        case $1 in
            --name) name=${2:?--name needs a value}; shift 2 ;;
            --name=*) name=${1#*=}; shift ;;
            --wait) wait_secs=${2:?--wait needs a value}; shift 2 ;;
            --wait=*) wait_secs=${1#*=}; shift ;;
            -h | --help) usage; exit 0 ;;
            -*) die "host: unknown option $1 (see --help)" ;;
            *) [[ -z $netdev ]] || die "host: more than one NETDEV given"
               netdev=$1; shift ;;
        esac
    done
    [[ $wait_secs =~ ^[0-9]+$ ]] || die "--wait must be a number of seconds"
    ((EUID == 0)) || die "host mode needs root (modprobe, ip, rdma link add)"
    for tool in modprobe ip rdma; do
        command -v "$tool" >/dev/null ||
            die "$tool not found; run '$PROG deps' (packages kmod, iproute2)"
    done

    # The kernel modules: the rxe driver, the verbs user interface
    # (/dev/infiniband/uverbs*) and the RDMA-CM user interface (rdma_cm).
    local mod
    for mod in rdma_rxe ib_uverbs rdma_ucm; do
        modprobe "$mod" || die "cannot load $mod: kernel $(uname -r) has no" \
            "Soft-RoCE support; use '$PROG vm -- CMD' instead"
    done

    if [[ -z $netdev ]]; then
        ensure_veth
        netdev=$VETH0
    fi
    ip link show dev "$netdev" >/dev/null 2>&1 || die "no such netdev: $netdev"

    local existing
    existing=$(rdma_dev_on_netdev "$netdev")
    if [[ -n $existing ]]; then
        log "$existing already exists on $netdev (state:" \
            "$(cat "/sys/class/infiniband/$existing/ports/1/state" 2>/dev/null || echo '?'));" \
            "nothing to do"
        return 0
    fi
    [[ ! -e /sys/class/infiniband/$name ]] ||
        die "an RDMA device named $name already exists on another netdev; use --name"

    ip link set dev "$netdev" up
    rdma link add "$name" type rxe netdev "$netdev"
    wait_active "$name" "$wait_secs" || exit 1
    local gid_index
    gid_index=$(ipv4_gid_index "$name")
    log "$name on $netdev is ACTIVE; IPv4-mapped GID index:" \
        "${gid_index:-none (no IPv4 address on $netdev)}"
}

# ============================================================================
# deps mode
# ============================================================================

deps_mode() {
    ((EUID == 0)) || die "deps needs root (apt-get install)"
    command -v apt-get >/dev/null || die "deps needs apt-get (Debian/Ubuntu)"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${DEB_PACKAGES[@]}"
}

# ============================================================================
# vm mode, host side
# ============================================================================

# Newest kernel that has both /boot/vmlinuz-VER and rdma_rxe.ko in
# /lib/modules/VER (not necessarily the running kernel).
pick_kernel() {
    local dir ver
    for dir in /lib/modules/*/; do
        ver=${dir%/}; ver=${ver##*/}
        [[ -r /boot/vmlinuz-$ver ]] || continue
        [[ -n $(find "$dir" -name 'rdma_rxe.ko*' -print -quit 2>/dev/null) ]] || continue
        printf '%s\n' "$ver"
    done | sort -V | tail -n 1
}

# Modules (paths in load order, deduplicated) the initramfs insmods: virtio
# serial for CMD's output, virtio 9p and overlay for the root file system,
# veth and Soft-RoCE for rxe0 (plus crc32_generic, which rdma_rxe requests at
# run time and which the initramfs cannot autoload: it has no /sbin/modprobe).
# Built-in ones are skipped.
# Loading them from the initramfs with the static busybox is much faster
# under TCG than kmod's modprobe reading them over 9p.
initramfs_modules() {
    local ver=$1 m
    for m in virtio_pci virtio_console 9pnet_virtio 9p overlay veth \
        crc32_generic rdma_rxe ib_uverbs rdma_ucm; do
        modprobe -S "$ver" --show-depends "$m" ||
            die "modprobe -S $ver --show-depends $m failed"
    done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }'
}

# The initramfs /init (busybox sh).  Everything that busybox can do is done
# here, before switch_root, because every exec of a dynamically linked program
# from the 9p root costs ~60 ms under TCG (a static busybox applet ~15 ms):
#  - load the modules (virtio console and 9p, overlay, veth, rdma_rxe,
#    ib_uverbs, rdma_ucm), find the virtio port for CMD's output;
#  - root: the host's / (9p, read-only) under a tmpfs overlay, with a fresh
#    /tmp and /run; the control share at /run/phalanx-vm; the host's current
#    directory (path in the control share's file cwd) read-write at the same
#    path; /dev/pts, /dev/shm, /dev/fd;
#  - network: lo up, veth pair rxenet0 (10.181.0.1/24) <-> rxenet1, both up,
#    and rxe0 on rxenet0, with the host's `ip` and `rdma` tools (chroot into
#    the new root);
# then switch_root into this script's copy in the control share, run as
# `__guest` (guest_mode below).  On failure it powers off; the host then
# reports exit status 125 because no rc file was written.
initramfs_init() {
    local opts9p=trans=virtio,version=9p2000.L,msize=512000 ip rdma
    # Absolute paths: busybox's chroot would run its own applet for "ip".
    ip=$(command -v ip) || die "ip not found; run '$PROG deps' (iproute2)"
    rdma=$(command -v rdma) || die "rdma not found; run '$PROG deps' (iproute2)"
    cat <<EOF
#!/bin/busybox sh
# phalanx-vm initramfs /init (generated by soft-roce-setup.sh)
/bin/busybox mkdir -p /dev /proc /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "phalanx-vm initramfs: \$*"; poweroff -f; sleep 10; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
while read -r m; do
    insmod "/mods/\$m" || fail "insmod \$m failed"
done </mods/order
# The virtio serial port named $OUT_PORT carries CMD's output to the host's
# stdout (fast, and not a tty: no \\n -> \\r\\n translation).  Its device
# (/dev/vportNpM) appears once qemu has announced the port; link it to
# /dev/$OUT_PORT.
i=0
until [ -e /dev/$OUT_PORT ]; do
    for p in /sys/class/virtio-ports/*; do
        [ -r \$p/name ] && read -r n <\$p/name && [ "\$n" = $OUT_PORT ] &&
            ln -sf \${p##*/} /dev/$OUT_PORT
    done
    [ -e /dev/$OUT_PORT ] && break
    i=\$((i + 1)); [ \$i -lt 50 ] || fail "no virtio port $OUT_PORT"
    sleep 0.1
done

R=/newroot C=/newroot$GUEST_CTL
mkdir -p /lower /rw \$R
# The virtio device may take a moment to be probed: retry for up to 5 s.
i=0
until mount -t 9p -o ro,$opts9p,cache=loose $TAG_ROOT /lower 2>/dev/null; do
    i=\$((i + 1)); [ \$i -lt 50 ] || fail "cannot mount the host root (9p $TAG_ROOT)"
    sleep 0.1
done
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work \$R ||
    fail "cannot mount the overlay root"
mount -t tmpfs -o mode=1777 tmpfs \$R/tmp || fail "tmpfs /tmp"
mount -t tmpfs -o mode=0755 tmpfs \$R/run || fail "tmpfs /run"
mkdir -p \$C
mount -t 9p -o $opts9p $TAG_CTL \$C || fail "cannot mount the control share"
read -r cwd <\$C/cwd
mkdir -p "\$R\$cwd"
mount -t 9p -o $opts9p,cache=mmap $TAG_CWD "\$R\$cwd" ||
    fail "cannot mount the current directory share at \$cwd"

mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
for d in dev proc sys; do mount --move /\$d \$R/\$d || fail "move /\$d"; done

hostname phalanx-vm
# iproute2's ip and rdma from the host root (busybox ip ignores "peer name");
# one ip process for all the network commands.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
chroot \$R $ip -batch - <<NETCFG || fail "network setup failed"
link set lo up
link add $VETH0 type veth peer name $VETH1
addr add $VETH_ADDR/$VETH_PREFIX dev $VETH0
link set $VETH0 up
link set $VETH1 up
NETCFG
chroot \$R $rdma link add $DEFAULT_DEV type rxe netdev $VETH0 ||
    fail "rdma link add $DEFAULT_DEV failed"

exec switch_root \$R /bin/bash $GUEST_CTL/soft-roce-setup.sh __guest $GUEST_CTL
fail "switch_root failed"
EOF
}

# Build (if missing or stale) the initramfs for kernel $1 into the cache dir
# $3 and print its path.  $2 = 1 forces a rebuild.
ensure_initramfs() {
    local ver=$1 force=$2 cache=$3 mods init key out stage m name
    mkdir -p "$cache"
    mods=$(initramfs_modules "$ver")
    init=$(initramfs_init)
    key=$(printf '%s\n%s\n%s\n' "$INITRAMFS_FORMAT" "$mods" "$init" |
        sha256sum | cut -c1-12)
    out=$cache/initramfs-$ver-$key.cpio.gz
    # Rebuild when forced, missing, or older than the kernel's module tree.
    if ((force == 0)) && [[ -s $out && ! /lib/modules/$ver/modules.dep -nt $out ]]; then
        touch -c "$out" 2>/dev/null || true
        printf '%s\n' "$out"
        return 0
    fi

    local busybox
    busybox=$(command -v busybox || true)
    [[ -n $busybox ]] || die "busybox not found; run '$PROG deps' (busybox-static)"
    if ldd "$busybox" 2>/dev/null | grep -q '=>'; then
        die "$busybox is dynamically linked; install busybox-static"
    fi
    command -v cpio >/dev/null || die "cpio not found; run '$PROG deps'"

    log "building initramfs for kernel $ver in $cache"
    stage=$(mktemp -d "$cache/.build.XXXXXX")
    # shellcheck disable=SC2064  # expand $stage now
    trap "rm -rf '$stage'; trap - RETURN" RETURN
    mkdir -p "$stage"/{bin,dev,proc,sys,mods}
    cp "$busybox" "$stage/bin/busybox"
    : >"$stage/mods/order"
    while IFS= read -r m; do
        [[ -n $m ]] || continue
        name=${m##*/}
        # busybox insmod wants plain .ko files; decompress if needed.
        case $name in
            *.ko.xz) xz -dc "$m" >"$stage/mods/${name%.xz}"; name=${name%.xz} ;;
            *.ko.zst) zstd -qdc "$m" >"$stage/mods/${name%.zst}"; name=${name%.zst} ;;
            *.ko.gz) gzip -dc "$m" >"$stage/mods/${name%.gz}"; name=${name%.gz} ;;
            *) cp "$m" "$stage/mods/$name" ;;
        esac
        printf '%s\n' "$name" >>"$stage/mods/order"
    done <<<"$mods"
    printf '%s\n' "$init" >"$stage/init"
    chmod 0755 "$stage/init"
    (cd "$stage" && find . -mindepth 1 | LC_ALL=C sort |
        cpio -o -H newc --quiet -R 0:0) | gzip -1 >"$out.tmp.$$"
    mv -f "$out.tmp.$$" "$out"
    # Prune builds unused for a week (not the others right away: a run of
    # another version of this script may be about to boot one).
    find "$cache" -maxdepth 1 -name 'initramfs-*.cpio.gz' -mtime +7 -delete
    printf '%s\n' "$out"
}

# Print the kernel image qemu should boot for kernel $1, caching in dir $2.
# Under TCG, decompressing the (xz) bzImage costs ~5 s of every boot.  qemu
# boots an uncompressed ELF vmlinux directly if the kernel has a PVH entry
# point (CONFIG_PVH=y, as Debian's has), so extract it once into the cache.
# Falls back to /boot/vmlinuz-VER itself.
boot_image() {
    local ver=$1 cache=$2 img=/boot/vmlinuz-$1 out off
    out=$cache/vmlinux-$ver
    if [[ -s $out && ! $img -nt $out ]]; then
        printf '%s\n' "$out"
        return 0
    fi
    if grep -qx 'CONFIG_PVH=y' "/boot/config-$ver" 2>/dev/null &&
        command -v xz >/dev/null; then
        # Offset of the xz stream's magic (fd 37 7a 58 5a 00) in the bzImage.
        off=$(LC_ALL=C grep -m1 -obUaF $'\xfd7zXZ' "$img" || true)
        off=${off%%:*}
        if [[ $off =~ ^[0-9]+$ ]] &&
            { tail -c +"$((off + 1))" "$img" || true; } |
            xz -qdc --single-stream >"$out.tmp.$$" 2>/dev/null &&
            [[ $(head -c 4 "$out.tmp.$$") == $'\x7fELF' ]]; then
            mv -f "$out.tmp.$$" "$out"
            printf '%s\n' "$out"
            return 0
        fi
        rm -f "$out.tmp.$$"
    fi
    printf '%s\n' "$img"
}

# Does environment variable name $1 match the pass-through list?
env_passes() {
    local pat
    for pat in "${PASS_ENV[@]}"; do
        # shellcheck disable=SC2053  # $pat is a glob on purpose
        [[ $1 == $pat ]] && return 0
    done
    return 1
}

# Print the guest's serial console log $1 (kernel messages, the initramfs's
# and guest setup's messages) to stderr: all of it ($2 = all) or, after a
# normal run, only lines other than the routine power-off message.
show_console_log() {
    local file=$1 what=$2 line
    [[ -s $file ]] || return 0
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line//$'\r'/}
        [[ -n $line ]] || continue
        if [[ $what != all ]]; then
            [[ $line == *'reboot: Power down' ]] && continue
        fi
        printf 'guest console: %s\n' "$line" >&2
    done <"$file"
}

# State for the cleanup trap of vm mode.
VM_WORK='' QEMU_PID='' WATCHDOG_PID=''

vm_cleanup() {
    if [[ -n $WATCHDOG_PID ]]; then
        kill "$WATCHDOG_PID" 2>/dev/null || true
        wait "$WATCHDOG_PID" 2>/dev/null || true
    fi
    if [[ -n $QEMU_PID ]] && kill -0 "$QEMU_PID" 2>/dev/null; then
        kill -TERM "$QEMU_PID" 2>/dev/null || true
        local i
        for i in $(seq 50); do
            kill -0 "$QEMU_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
    fi
    [[ -z $VM_WORK ]] || rm -rf -- "$VM_WORK"
}

vm_mode() {
    DIE_STATUS=125
    local timeout=${PHALANX_VM_TIMEOUT:-1200} mem=${PHALANX_VM_MEM:-4096}
    local smp=${PHALANX_VM_SMP:-} accel=${PHALANX_VM_ACCEL:-tcg} ver=''
    local rebuild=0 verbose=0 extra_env=()
    while (($#)); do
        case $1 in
            --timeout) timeout=${2:?--timeout needs a value}; shift 2 ;;
            --timeout=*) timeout=${1#*=}; shift ;;
            --mem) mem=${2:?--mem needs a value}; shift 2 ;;
            --mem=*) mem=${1#*=}; shift ;;
            --smp) smp=${2:?--smp needs a value}; shift 2 ;;
            --smp=*) smp=${1#*=}; shift ;;
            --kernel) ver=${2:?--kernel needs a value}; shift 2 ;;
            --kernel=*) ver=${1#*=}; shift ;;
            --accel) accel=${2:?--accel needs a value}; shift 2 ;;
            --accel=*) accel=${1#*=}; shift ;;
            --env) extra_env+=("${2:?--env needs a value}"); shift 2 ;;
            --env=*) extra_env+=("${1#*=}"); shift ;;
            --rebuild) rebuild=1; shift ;;
            --verbose) verbose=1; shift ;;
            -h | --help) usage; exit 0 ;;
            --) shift; break ;;
            -*) die "vm: unknown option $1 (see --help)" ;;
            *) break ;;   # the command starts here
        esac
    done
    (($#)) || die "vm: no command given (usage: $PROG vm [options] -- CMD [ARGS...])"
    [[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds"
    [[ $mem =~ ^[1-9][0-9]*$ ]] || die "--mem must be a number of MB"
    if [[ -z $smp ]]; then
        smp=$(nproc 2>/dev/null || echo 2)
        ((smp <= 4)) || smp=4
    fi
    [[ $smp =~ ^[1-9][0-9]*$ ]] || die "--smp must be a positive number"

    command -v qemu-system-x86_64 >/dev/null ||
        die "qemu-system-x86_64 not found; run '$PROG deps' (needs root)"
    [[ -n $ver ]] || ver=$(pick_kernel)
    [[ -n $ver ]] || die "no kernel with rdma_rxe.ko under /lib/modules and" \
        "/boot/vmlinuz-VER; run '$PROG deps' (linux-image-amd64)"
    [[ -r /boot/vmlinuz-$ver ]] || die "cannot read /boot/vmlinuz-$ver"

    local cwd
    cwd=$(pwd -P)
    [[ $cwd != / ]] || die "refusing to share / read-write; cd to the project first"
    [[ $cwd != *$'\n'* ]] || die "the current directory's path contains a newline"

    local cache initrd kimg
    cache=${PHALANX_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-vm}
    initrd=$(ensure_initramfs "$ver" "$rebuild" "$cache")
    kimg=$(boot_image "$ver" "$cache")

    # Work dir: ctl/ is shared with the guest (command, environment, exit
    # status); the rest stays on the host.
    trap vm_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP
    VM_WORK=$(mktemp -d "${TMPDIR:-/tmp}/phalanx-vm.XXXXXX")
    local ctl=$VM_WORK/ctl
    mkdir -p "$ctl"
    chmod 0755 "$VM_WORK" "$ctl"
    cp "$SELF" "$ctl/soft-roce-setup.sh"

    # Environment for the command, as a sourced bash file with quoted values.
    {
        local name entry
        while IFS= read -r name; do
            env_passes "$name" && printf 'export %s=%q\n' "$name" "${!name}"
        done < <(compgen -e)
        for entry in "${extra_env[@]}"; do
            name=${entry%%=*}
            [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env: bad name '$name'"
            if [[ $entry == *=* ]]; then
                printf 'export %s=%q\n' "$name" "${entry#*=}"
            elif [[ -v $name ]]; then
                printf 'export %s=%q\n' "$name" "${!name}"
            fi
        done
    } >"$ctl/env.sh"

    # The command line, quoted, as a script; run with bash in the guest.
    {
        printf '#!/bin/bash\n'
        printf 'exec'
        printf ' %q' "$@"
        printf '\n'
    } >"$ctl/cmd.sh"
    printf '%s\n' "$cwd" >"$ctl/cwd"
    printf '%s\n' "$timeout" >"$ctl/timeout"
    printf '%s\n' "$verbose" >"$ctl/verbose"

    # qemu's -virtfs option is comma separated: double commas in paths.
    local log=$VM_WORK/console.log
    local q_cwd=${cwd//,/,,} q_ctl=${ctl//,/,,} q_log=${log//,/,,}
    # mitigations=off: a throw-away test VM; saves time under TCG.
    local append="console=ttyS0 panic=-1 rdinit=/init mitigations=off"
    ((verbose)) || append+=" quiet"
    local accel_opt=$accel
    [[ $accel != tcg ]] || accel_opt=tcg,thread=multi
    local qemu=(
        qemu-system-x86_64
        -accel "$accel_opt" -cpu max -smp "$smp" -m "$mem"
        -display none -no-reboot -nodefaults -monitor none
        -nic none
        -chardev "file,id=log,path=$q_log" -serial chardev:log
        -device virtio-serial-pci -chardev "stdio,id=out,signal=off"
        -device "virtserialport,chardev=out,name=$OUT_PORT"
        -kernel "$kimg" -initrd "$initrd" -append "$append"
        -virtfs "local,path=/,mount_tag=$TAG_ROOT,security_model=none,readonly=on,multidevs=remap"
        -virtfs "local,path=$q_cwd,mount_tag=$TAG_CWD,security_model=none,multidevs=remap"
        -virtfs "local,path=$q_ctl,mount_tag=$TAG_CTL,security_model=none"
    )
    ((verbose == 0)) || log "kernel $ver, initramfs $initrd; ${qemu[*]}"

    # Run qemu in the background so that this shell can enforce the timeout
    # and handle Ctrl-C (background jobs of a script ignore SIGINT; the traps
    # above kill qemu).  qemu's stdin is a FIFO that qemu itself holds open
    # for writing too: never a tty (qemu leaves the terminal alone) and never
    # at EOF (on EOF qemu would mark the stdio port as closed, and the guest's
    # writes to it would block forever).
    mkfifo "$VM_WORK/stdin"
    local start=$SECONDS
    "${qemu[@]}" <>"$VM_WORK/stdin" &
    QEMU_PID=$!
    # Watchdog: after $timeout seconds note the timeout and stop qemu.
    # Sleeps run in the background + wait, so that the TERM from the main
    # shell is handled at once.
    (
        sleeper=''
        trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
        sleep "$timeout" &
        sleeper=$!
        wait "$sleeper"
        : >"$VM_WORK/timed-out"
        kill -TERM "$QEMU_PID" 2>/dev/null || exit 0
        sleep 5 &
        sleeper=$!
        wait "$sleeper"
        kill -KILL "$QEMU_PID" 2>/dev/null || true
    ) &
    WATCHDOG_PID=$!

    local qrc=0
    wait "$QEMU_PID" || qrc=$?
    QEMU_PID=''
    kill "$WATCHDOG_PID" 2>/dev/null || true
    wait "$WATCHDOG_PID" 2>/dev/null || true
    WATCHDOG_PID=''
    local elapsed=$((SECONDS - start))

    local rc=''
    [[ -r $ctl/rc ]] && rc=$(<"$ctl/rc")
    if [[ -e $VM_WORK/timed-out ]]; then
        show_console_log "$log" all
        log "timeout: the VM ran longer than ${timeout}s; killed qemu (exit 124)"
        echo "phalanx-vm: exit status 124 (timeout)"
        exit 124
    fi
    if ! [[ $rc =~ ^[0-9]+$ ]]; then
        show_console_log "$log" all
        log "the VM exited (qemu status $qrc) without reporting an exit status" \
            "(exit 125)"
        echo "phalanx-vm: exit status 125 (VM setup failed)"
        exit 125
    fi
    if ((verbose)); then
        show_console_log "$log" all
    else
        show_console_log "$log" unusual
    fi
    ((verbose == 0)) || log "VM run took ${elapsed}s, command exit status $rc"
    exit "$rc"
}

# ============================================================================
# vm mode, guest side (runs as PID 1 after switch_root)
# ============================================================================

guest_poweroff() {
    sync
    # busybox (from busybox-static on the shared root) powers off directly;
    # the host's poweroff is systemctl, which needs a running systemd.
    busybox poweroff -f 2>/dev/null || true
    echo o >/proc/sysrq-trigger 2>/dev/null || true
    sleep 10
    # Still here: exiting PID 1 panics, and panic=-1 + -no-reboot ends qemu.
}

guest_mode() {
    local ctl=${1:?} rc_written=0
    export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    export HOME=/root

    # Whatever happens (a setup failure under set -e included): report a
    # status and power off.
    # shellcheck disable=SC2317  # called through the EXIT trap
    guest_exit() {
        local st=$?
        if ((rc_written == 0)); then
            echo "phalanx-vm: setup failed (status $st)"
            echo 125 >"$ctl/rc" 2>/dev/null || true
            echo "phalanx-vm: exit status 125" >"/dev/$OUT_PORT" 2>/dev/null || true
        fi
        guest_poweroff
    }
    trap guest_exit EXIT

    # The initramfs did the mounts, the network and `rdma link add rxe0`.
    # Only shell builtins up to the command: each exec costs under TCG.
    local verbose cwd timeout
    read -r verbose <"$ctl/verbose"
    read -r cwd <"$ctl/cwd"
    read -r timeout <"$ctl/timeout"

    # Backstop in case the host script died without killing qemu: power off
    # 60 s after the run's timeout.
    (
        sleep $((timeout + 60))
        echo "phalanx-vm: guest watchdog expired"
        echo o >/proc/sysrq-trigger
    ) &

    wait_active "$DEFAULT_DEV" 30
    # The IPv4-mapped GID is added with the device (the address was there
    # before it); allow a moment anyway.
    local gid_index='' i
    for ((i = 0; i < 50; i++)); do
        gid_index=$(ipv4_gid_index "$DEFAULT_DEV")
        [[ -z $gid_index ]] || break
        sleep 0.1
    done
    [[ -n $gid_index ]] || echo "phalanx-vm: warning: no IPv4-mapped GID on $DEFAULT_DEV"
    if ((verbose)); then
        rdma link show
        print_gids "$DEFAULT_DEV"
    fi

    export PHALANX_RXE_DEV=$DEFAULT_DEV PHALANX_RXE_NETDEV=$VETH0
    export PHALANX_RXE_ADDR=$VETH_ADDR PHALANX_RXE_GID_INDEX=$gid_index

    # RDMA memory registration pins pages.
    ulimit -l unlimited

    # CMD's stdout and stderr go to the virtio port (the host's stdout); this
    # script's own messages go to the serial console (a log on the host).
    local rc=0
    cd "$cwd"
    set +e
    (
        # shellcheck disable=SC1091
        . "$ctl/env.sh"
        # cmd.sh is `exec CMD ARGS...`.
        # shellcheck disable=SC1091
        . "$ctl/cmd.sh"
    ) </dev/null >/dev/$OUT_PORT 2>&1
    rc=$?
    set -e
    # Flush what CMD wrote (e.g. mmap'ed files in the cwd share) before
    # telling the host the status.
    sync
    echo "$rc" >"$ctl/rc"
    rc_written=1
    echo "phalanx-vm: exit status $rc" >/dev/$OUT_PORT
    exit "$rc"
}

# ============================================================================
# main
# ============================================================================

main() {
    local mode=host
    if (($#)); then
        case $1 in
            host | vm | deps | packages | __guest) mode=$1; shift ;;
            help | -h | --help) usage; exit 0 ;;
        esac
    fi
    case $mode in
        host) host_mode "$@" ;;
        vm) vm_mode "$@" ;;
        deps) deps_mode ;;
        packages) printf '%s\n' "${DEB_PACKAGES[@]}" ;;
        __guest) guest_mode "$@" ;;
    esac
}

main "$@"
