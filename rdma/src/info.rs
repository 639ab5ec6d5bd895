//! What `phalanx info` shows: the verbs library, every device with its ports, GID table and
//! NUMA placement (like `ibv_devinfo` and `show_gids`), and what a verbs transport would pick
//! under a given configuration.

use crate::topology::{self, DeviceTopology, Placement};
use crate::verbs::{sys, Context, GidInfo, VerbsError};
use crate::RdmaConfig;
use std::fmt::Write as _;
use std::net::Ipv6Addr;

/// One non-empty GID table entry.
#[derive(Debug, Clone)]
pub struct GidEntry {
    pub index: i32,
    pub gid: [u8; 16],
    /// The kernel's GID type ("RoCE v2", "IB/RoCE v1"), if sysfs tells.
    pub kind: Option<String>,
}

/// One port of a device.
#[derive(Debug, Clone)]
pub struct PortReport {
    pub port: u8,
    pub state: u32,
    pub link_layer: u8,
    /// `ibv_mtu` value (1 = 256 ... 5 = 4096).
    pub active_mtu: u32,
    pub lid: u16,
    pub gids: Vec<GidEntry>,
}

/// One device.
#[derive(Debug, Clone)]
pub struct DeviceReport {
    pub name: String,
    pub topology: DeviceTopology,
    pub ports: Vec<PortReport>,
    /// Why the device could not be queried (it is listed anyway).
    pub error: Option<String>,
}

/// The verbs library and every device.
#[derive(Debug, Clone)]
pub struct Survey {
    /// The library opened, or why it could not be.
    pub library: Result<String, String>,
    pub devices: Vec<DeviceReport>,
}

pub fn port_state_name(s: u32) -> &'static str {
    match s {
        sys::IBV_PORT_NOP => "NOP",
        sys::IBV_PORT_DOWN => "DOWN",
        sys::IBV_PORT_INIT => "INIT",
        sys::IBV_PORT_ARMED => "ARMED",
        sys::IBV_PORT_ACTIVE => "ACTIVE",
        sys::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "UNKNOWN",
    }
}

pub fn link_layer_name(l: u8) -> &'static str {
    match l {
        sys::IBV_LINK_LAYER_INFINIBAND => "InfiniBand",
        sys::IBV_LINK_LAYER_ETHERNET => "Ethernet (RoCE)",
        // Unspecified: InfiniBand by convention (old providers).
        _ => "unspecified (InfiniBand)",
    }
}

/// Bytes of an `ibv_mtu` value.
pub fn mtu_bytes(m: u32) -> u32 {
    if (sys::IBV_MTU_256..=sys::IBV_MTU_4096).contains(&m) {
        128 << m
    } else {
        0
    }
}

pub fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// A GID as an IPv6 address (`fe80::...`, `::ffff:10.0.0.1`).
pub fn gid_text(gid: &[u8; 16]) -> String {
    Ipv6Addr::from(*gid).to_string()
}

fn port_report(ctx: &Context, port: u8) -> Result<PortReport, VerbsError> {
    let p = ctx.query_port(port)?;
    let mut gids = Vec::new();
    for i in 0..p.gid_tbl_len.clamp(0, 1024) {
        let Ok(gid) = ctx.query_gid(port, i) else {
            continue;
        };
        if gid.iter().all(|&b| b == 0) {
            continue;
        }
        gids.push(GidEntry {
            index: i,
            gid,
            kind: ctx.gid_type(port, i),
        });
    }
    Ok(PortReport {
        port,
        state: p.state,
        link_layer: p.link_layer,
        active_mtu: p.active_mtu,
        lid: p.lid,
        gids,
    })
}

/// Loads the library and queries every device (errors end up in the report).
pub fn survey() -> Survey {
    let lib = match sys::lib() {
        Ok(l) => l,
        Err(e) => {
            return Survey {
                library: Err(e.to_string()),
                devices: Vec::new(),
            }
        }
    };
    let names = crate::verbs::list_devices().unwrap_or_default();
    let devices = names
        .into_iter()
        .map(|name| {
            let topology = topology::device_topology(&name);
            let mut d = DeviceReport {
                name: name.clone(),
                topology,
                ports: Vec::new(),
                error: None,
            };
            match Context::open(Some(&name)) {
                Ok(ctx) => {
                    for port in 1..=ctx.port_count() {
                        match port_report(&ctx, port) {
                            Ok(p) => d.ports.push(p),
                            Err(e) => d.error = Some(format!("port {port}: {e}")),
                        }
                    }
                }
                Err(e) => d.error = Some(e.to_string()),
            }
            d
        })
        .collect();
    Survey {
        library: Ok(lib.name.clone()),
        devices,
    }
}

fn numa_text(t: &DeviceTopology) -> String {
    match t.numa_node {
        Some(n) => format!(
            "NUMA node {n} ({}), cores near it: {}",
            if t.source == "the only NUMA node" {
                "the only one"
            } else {
                "from sysfs"
            },
            if t.local_cpus.is_empty() {
                "unknown".into()
            } else {
                topology::format_cpulist(&t.local_cpus)
            }
        ),
        None => "NUMA node unknown (no placement)".into(),
    }
}

impl Survey {
    /// The report as text (several lines).
    pub fn render(&self) -> String {
        let mut s = String::new();
        match &self.library {
            Ok(name) => {
                let _ = writeln!(s, "verbs library: {name} (loaded at run time)");
            }
            Err(e) => {
                let _ = writeln!(s, "verbs library: {e}");
                let _ = writeln!(s, "RDMA devices: none (no verbs library)");
                return s;
            }
        }
        if self.devices.is_empty() {
            let _ = writeln!(s, "RDMA devices: none (no RDMA device found)");
            return s;
        }
        let _ = writeln!(s, "RDMA devices: {}", self.devices.len());
        for d in &self.devices {
            let _ = writeln!(s, "{}: {}", d.name, numa_text(&d.topology));
            if let Some(e) = &d.error {
                let _ = writeln!(s, "  error: {e}");
            }
            for p in &d.ports {
                let _ = writeln!(
                    s,
                    "  port {}: {}, link layer {}, active MTU {}, LID {}",
                    p.port,
                    port_state_name(p.state),
                    link_layer_name(p.link_layer),
                    mtu_bytes(p.active_mtu),
                    p.lid
                );
                if p.gids.is_empty() {
                    let _ = writeln!(s, "    GID table: empty");
                }
                for g in &p.gids {
                    let _ = writeln!(
                        s,
                        "    GID[{:>3}] {:<40} {}{}",
                        g.index,
                        gid_text(&g.gid),
                        g.kind.as_deref().unwrap_or("type unknown"),
                        if is_ipv4_mapped(&g.gid) {
                            ", IPv4-mapped"
                        } else {
                            ""
                        }
                    );
                }
            }
        }
        s
    }
}

/// What a verbs transport of node `id` would use under `cfg`.
#[derive(Debug, Clone)]
pub struct Choice {
    pub device: String,
    pub port: u8,
    pub gid: GidInfo,
    pub gid_kind: Option<String>,
    pub placement: Placement,
}

/// Makes the choices [`crate::RdmaTransport::bind`] makes (device, ACTIVE port, GID, placement)
/// without binding anything.
pub fn choose(cfg: &RdmaConfig, id: u32) -> Result<Choice, VerbsError> {
    let ctx = Context::open(cfg.device.as_deref())?;
    let port = ctx.query_port(cfg.port)?;
    if !port.active {
        return Err(VerbsError::Invalid(format!(
            "{} port {} is {}, not ACTIVE",
            ctx.name(),
            cfg.port,
            port_state_name(port.state)
        )));
    }
    let gid = ctx.select_gid(cfg.port, cfg.gid_index)?;
    Ok(Choice {
        device: ctx.name().to_string(),
        port: cfg.port,
        gid_kind: ctx.gid_type(cfg.port, gid.index as i32),
        gid,
        placement: Placement::plan(ctx.name(), id, cfg),
    })
}

impl Choice {
    pub fn render(&self, busy_poll: bool) -> String {
        format!(
            "device {} port {}, GID[{}] {} ({}); {}",
            self.device,
            self.port,
            self.gid.index,
            gid_text(&self.gid.gid),
            self.gid_kind.as_deref().unwrap_or("type unknown"),
            self.placement.describe(busy_poll)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_formats() {
        assert_eq!(port_state_name(4), "ACTIVE");
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 2, 15]);
        assert!(is_ipv4_mapped(&g));
        assert_eq!(gid_text(&g), "::ffff:10.0.2.15");
    }

    #[test]
    fn survey_without_devices_says_so() {
        let s = survey();
        let text = s.render();
        if s.devices.is_empty() {
            assert!(
                text.contains("RDMA devices: none"),
                "without devices the report says so: {text}"
            );
        } else {
            assert!(text.contains("port 1:"), "{text}");
        }
    }
}
