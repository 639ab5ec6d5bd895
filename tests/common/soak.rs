//! The loop of the randomized soaks (`allreduce_soak.rs`, `broadcast_soak.rs`): cases drawn
//! from consecutive seeds, bounded by `PHALANX_SOAK_RUNS`, from `PHALANX_SOAK_SEED`; a
//! failure names its case, and so its seed, which alone replays it.

use phalanx::transport::TcpConfig;
use phalanx::{LocalCluster, NodeConfig};
use std::fmt::Debug;
use std::time::Duration;

/// A soak case's cluster: `nodes` nodes of `arena` bytes each, on loopback, that find a dead
/// node within a second (heartbeats, or with links made `on_demand` their ring watchers) and
/// tell its objects' readers they are lost a second later (a coordinator's death, too);
/// operations give up after 30 s.
pub fn cluster(nodes: usize, arena: u64, on_demand: bool) -> Result<LocalCluster, String> {
    let cfg = NodeConfig {
        arena_size: arena,
        op_timeout: Duration::from_secs(30),
        lost_after: Duration::from_secs(1),
        ..NodeConfig::default()
    };
    let tcp = TcpConfig {
        heartbeat_timeout: Duration::from_secs(1),
        ..TcpConfig::default()
    };
    let tcp = match on_demand {
        true => tcp.on_demand(),
        false => tcp,
    };
    LocalCluster::start(nodes as u32, cfg, tcp).map_err(|e| e.to_string())
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `PHALANX_SOAK_RUNS` cases (default `runs`) from seed `PHALANX_SOAK_SEED` (default
/// 1), each drawn from its seed by `draw` and run by `run`, and panics with the case on the
/// first failure. Returns how many ran, from which seed, and how many `deadly` says kill a
/// node.
pub fn soak<C: Debug>(
    runs: u64,
    draw: impl Fn(u64) -> C,
    deadly: impl Fn(&C) -> bool,
    run: impl Fn(C) -> Result<Duration, String>,
) -> (u64, u64, usize) {
    let runs = env_u64("PHALANX_SOAK_RUNS", runs);
    let first = env_u64("PHALANX_SOAK_SEED", 1);
    let mut deaths = 0;
    for seed in first..first + runs {
        let case = draw(seed);
        let what = format!("{case:?}");
        deaths += usize::from(deadly(&case));
        match run(case) {
            Ok(took) => println!("{what}: ok in {:.1} ms", took.as_secs_f64() * 1e3),
            Err(e) => panic!("{what}: {e}"),
        }
    }
    (runs, first, deaths)
}
