//! `phalanx info`: the verbs library, devices, ports, GIDs and NUMA placement, and what this
//! configuration would pick.

use crate::Transport;
use anyhow::Result;
use phalanx::transport::NodeId;
use phalanx::{ClusterConfig, TransportKind, TransportSettings};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct InfoArgs {
    /// The cluster config (TOML) to evaluate; default: the built-in defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Node id the choice is made for (busy-poll cores are spread by id).
    #[arg(long, default_value_t = 0)]
    id: NodeId,
    /// Evaluate this transport instead of the config's.
    #[arg(long, value_enum)]
    transport: Option<Transport>,
    /// Verbs device (overrides the config's).
    #[arg(long)]
    device: Option<String>,
    /// RoCE GID index (overrides the config's).
    #[arg(long)]
    gid_index: Option<u8>,
}

pub fn run(a: InfoArgs) -> Result<()> {
    let cfg = match &a.config {
        Some(p) => Some(ClusterConfig::load(p)?),
        None => None,
    };
    let mut kind = cfg.as_ref().map_or(TransportKind::Tcp, |c| c.transport);
    if let Some(t) = a.transport {
        kind = t.into();
    }
    let source = match &a.config {
        Some(p) => format!("config {}", p.display()),
        None => "the defaults (no --config)".into(),
    };
    print!("{}", survey());
    println!();
    println!("Phalanx with {source}, node {}:", a.id);
    println!(
        "  transport: {}",
        match kind {
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
        }
    );
    let verbs = rdma_choice(cfg.as_ref(), &a);
    match kind {
        TransportKind::Rdma => println!("  verbs: {verbs}"),
        TransportKind::Tcp => println!("  with transport = \"rdma\" it would use: {verbs}"),
    }
    Ok(())
}

#[cfg(feature = "rdma")]
fn survey() -> String {
    phalanx::rdma::info::survey().render()
}

#[cfg(not(feature = "rdma"))]
fn survey() -> String {
    "verbs: this binary was built without the `rdma` feature\n".into()
}

/// What the verbs transport would pick (or why it could not start), on one line.
#[cfg(feature = "rdma")]
fn rdma_choice(cfg: Option<&ClusterConfig>, a: &InfoArgs) -> String {
    let settings = match cfg {
        Some(c) => {
            let mut c = c.clone();
            c.transport = TransportKind::Rdma;
            TransportSettings::from_cluster_config(&c)
        }
        None => TransportSettings::new(
            TransportKind::Rdma,
            std::time::Duration::from_secs(1),
            None,
            None,
        ),
    };
    let mut r = match settings {
        Ok(TransportSettings::Rdma(r)) => r,
        Ok(_) => return "not the verbs transport".into(),
        Err(e) => return format!("cannot start: {e}"),
    };
    r.device = a.device.clone().or(r.device);
    r.gid_index = a.gid_index.or(r.gid_index);
    match phalanx::rdma::info::choose(&r, a.id) {
        Ok(c) => c.render(r.busy_poll),
        Err(e) => format!("cannot start: {e}"),
    }
}

#[cfg(not(feature = "rdma"))]
fn rdma_choice(_: Option<&ClusterConfig>, _: &InfoArgs) -> String {
    "cannot start: this binary was built without the `rdma` feature".into()
}
