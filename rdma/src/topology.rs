//! Where an RDMA device sits: its NUMA node and the cores near it, read from sysfs, and the
//! two placements Phalanx makes with it (the registered memory on that node, the busy-polling
//! progress thread on one of those cores).
//!
//! sysfs rather than hwloc: the kernel publishes exactly the two facts needed
//! (`/sys/class/infiniband/<dev>/device/numa_node` and `local_cpulist`, or
//! `/sys/devices/system/node/node<N>/cpulist`), so the default build needs no C library and
//! runs on every Linux machine. On a machine with one NUMA node that node is the answer
//! whatever the device says; where the facts cannot be read otherwise (a software device
//! such as rxe on a netdev without a NUMA node on a multi-node machine, a kernel without
//! NUMA), placement is simply off.

use std::path::Path;

/// The NUMA node and nearby cores of one device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceTopology {
    /// NUMA node of the device (`None`: unknown, e.g. -1 in sysfs or no NUMA support).
    pub numa_node: Option<u32>,
    /// Cores local to the device (its node's cores), sorted; empty when unknown.
    pub local_cpus: Vec<usize>,
    /// Where the facts came from (a sysfs path), for `phalanx info`.
    pub source: String,
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Parses a kernel cpu list ("0-3,8,10-11").
pub fn parse_cpulist(s: &str) -> Vec<usize> {
    let mut v = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    v.extend(a..=b.min(a + 65536));
                }
            }
            None => {
                if let Ok(a) = part.trim().parse() {
                    v.push(a);
                }
            }
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// Formats cores as a kernel cpu list ("0-3,8").
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", cpus[i], cpus[j])
        } else {
            cpus[i].to_string()
        });
        i = j + 1;
    }
    out.join(",")
}

/// The cores of NUMA node `node` (empty if unknown).
pub fn node_cpus(node: u32) -> Vec<usize> {
    read_trim(&Path::new("/sys/devices/system/node").join(format!("node{node}/cpulist")))
        .map(|s| parse_cpulist(&s))
        .unwrap_or_default()
}

/// Reads a device directory (`.../device` of an RDMA device or of a netdev): numa_node and
/// local_cpulist.
fn from_device_dir(dir: &Path) -> Option<DeviceTopology> {
    let node: i64 = read_trim(&dir.join("numa_node"))?.parse().ok()?;
    let node = u32::try_from(node).ok()?; // -1: the platform does not say
    let mut cpus = read_trim(&dir.join("local_cpulist"))
        .map(|s| parse_cpulist(&s))
        .unwrap_or_default();
    if cpus.is_empty() {
        cpus = node_cpus(node);
    }
    Some(DeviceTopology {
        numa_node: Some(node),
        local_cpus: cpus,
        source: dir.display().to_string(),
    })
}

/// The topology of RDMA device `dev` (e.g. "mlx5_0", "rxe0"): its own PCI device, or for a
/// software device (rxe, siw) the netdev under it.
pub fn device_topology(dev: &str) -> DeviceTopology {
    let ib = Path::new("/sys/class/infiniband").join(dev);
    if let Some(t) = from_device_dir(&ib.join("device")) {
        return t;
    }
    // Software RoCE: the netdev of port 1's GIDs (gid_attrs/ndevs/<i>) or the parent netdev.
    let ndev = read_trim(&ib.join("parent")).or_else(|| {
        let d = ib.join("ports/1/gid_attrs/ndevs");
        (0..16).find_map(|i| read_trim(&d.join(i.to_string())).filter(|s| !s.is_empty()))
    });
    if let Some(n) = ndev {
        if let Some(t) = from_device_dir(&Path::new("/sys/class/net").join(n).join("device")) {
            return t;
        }
    }
    // One NUMA node: every device is on it, whatever the device says (-1 is common there).
    let online = read_trim(Path::new("/sys/devices/system/node/online"));
    if online.as_deref() == Some("0") {
        let cpus = node_cpus(0);
        if !cpus.is_empty() {
            return DeviceTopology {
                numa_node: Some(0),
                local_cpus: cpus,
                source: "the only NUMA node".into(),
            };
        }
    }
    DeviceTopology {
        numa_node: None,
        local_cpus: Vec::new(),
        source: "no NUMA information in sysfs".into(),
    }
}

/// The cores this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain old data; zero is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 = this thread; the size is that of `set`.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: i < CPU_SETSIZE, the bit range of `set`.
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect()
}

/// The core the busy-polling progress thread of node `id` takes: one of the device's local
/// cores this process may use, spread by `id` so the nodes of one process do not share one.
/// `None` when the device's cores are unknown or none of them is allowed.
pub fn progress_core(topo: &DeviceTopology, id: u32) -> Option<usize> {
    let allowed = allowed_cpus();
    let near: Vec<usize> = topo
        .local_cpus
        .iter()
        .copied()
        .filter(|c| allowed.contains(c))
        .collect();
    if near.is_empty() {
        return None;
    }
    // From the end of the list: core 0 of a node usually takes more interrupts.
    Some(near[near.len() - 1 - (id as usize % near.len())])
}

/// Pins the calling thread to `core`.
pub fn pin_current_thread(core: usize) -> std::io::Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: cpu_set_t is plain old data; zero is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: core < CPU_SETSIZE (checked above).
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 = the calling thread; the set is initialised and sized.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `MPOL_MF_MOVE` of `<linux/mempolicy.h>`: migrate pages already faulted in.
const MPOL_MF_MOVE: libc::c_uint = 1 << 1;

/// Asks the kernel to place `[addr, addr + len)` on NUMA node `node` (`MPOL_PREFERRED`, so an
/// exhausted node falls back instead of failing), moving pages already touched. `addr` must
/// be page aligned (an mmap'd arena is).
pub fn bind_memory(addr: *mut u8, len: usize, node: u32) -> std::io::Result<()> {
    if node >= 1024 {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut mask = [0u64; 16]; // 1024 nodes
    mask[(node / 64) as usize] |= 1u64 << (node % 64);
    // SAFETY: mbind only changes the memory policy of (and may migrate) pages of a mapping
    // the caller owns; the mask outlives the call and maxnode matches its bit count. It never
    // changes the contents of the memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr as libc::c_ulong,
            len as libc::c_ulong,
            libc::MPOL_PREFERRED as libc::c_ulong,
            mask.as_ptr(),
            (mask.len() * 64) as libc::c_ulong,
            MPOL_MF_MOVE as libc::c_ulong,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The NUMA node of the page at `addr` (touched), via `move_pages` in query mode.
pub fn node_of_page(addr: *const u8) -> Option<u32> {
    let pages = [addr as *mut libc::c_void];
    let mut status = [-1 as libc::c_int];
    // SAFETY: query mode (nodes = NULL) of move_pages on this process (pid 0) reads one
    // page's node into `status`; both arrays have one element, as `count` says.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_long,
            1 as libc::c_ulong,
            pages.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if rc != 0 {
        return None;
    }
    u32::try_from(status[0]).ok()
}

/// What a verbs transport does with the topology of its device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    pub topology: DeviceTopology,
    /// NUMA node the registered memory (the arena and the connection buffers) is bound to.
    pub memory_node: Option<u32>,
    /// Core the progress thread is pinned to (only with `busy_poll`).
    pub progress_core: Option<usize>,
}

impl Placement {
    /// The placement of node `id` on device `dev` under `cfg` (`numa_placement` off: none).
    pub fn plan(dev: &str, id: u32, cfg: &crate::RdmaConfig) -> Placement {
        if !cfg.numa_placement {
            return Placement::default();
        }
        let topology = device_topology(dev);
        let progress_core = if cfg.busy_poll {
            progress_core(&topology, id)
        } else {
            None
        };
        Placement {
            memory_node: topology.numa_node,
            progress_core,
            topology,
        }
    }

    /// One line for logs and `phalanx info`.
    pub fn describe(&self, busy_poll: bool) -> String {
        let mem = match self.memory_node {
            Some(n) => format!("registered memory on NUMA node {n}"),
            None => "registered memory: no NUMA placement (node unknown)".into(),
        };
        let core = match (busy_poll, self.progress_core) {
            (false, _) => "progress thread not pinned (event mode; busy_poll pins it)".into(),
            (true, Some(c)) => format!("busy-polling progress thread on core {c}"),
            (true, None) => "busy-polling progress thread not pinned (cores unknown)".into(),
        };
        format!("{mem}; {core}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_round_trip() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
        assert_eq!(format_cpulist(&[]), "");
    }

    #[test]
    fn progress_core_is_near_and_allowed() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        let topo = DeviceTopology {
            numa_node: Some(0),
            local_cpus: allowed.clone(),
            source: String::new(),
        };
        let c = progress_core(&topo, 0).unwrap();
        assert!(allowed.contains(&c));
        assert_eq!(progress_core(&DeviceTopology::default(), 0), None);
        // Pinning to an allowed core works and shows in the thread's mask.
        std::thread::spawn(move || {
            pin_current_thread(c).unwrap();
            assert_eq!(allowed_cpus(), vec![c]);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn memory_bound_to_node_0_lands_there() {
        let len = 4 << 20;
        let a = phalanx_transport::Arena::new(len, false).unwrap();
        match bind_memory(a.as_ptr(), len, 0) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                eprintln!("kernel without NUMA support: skipped");
                return;
            }
            Err(e) => panic!("mbind: {e}"),
        }
        // SAFETY: the arena is ours, mapped and writable, and nobody else uses it.
        unsafe { std::ptr::write_bytes(a.as_ptr(), 1, len) };
        if let Some(n) = node_of_page(a.as_ptr()) {
            assert_eq!(n, 0);
        }
    }
}
