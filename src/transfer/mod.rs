//! Transfers: the pull engine of one node. A receiver asks the directory for one source and
//! pulls from it (`pull.rs`, the whole receiver side); a source streams whatever it has, its
//! copy possibly still partial, chunk by chunk (`serve.rs`, the whole source side). A failed
//! or refused source is replaced and the pull resumes at the receiver's watermark.
//!
//! `Transfers` owns the inbound streams, the serving state, the records of both sides and the
//! bandwidth estimate; it is handed the store, the directory client, the messaging and the
//! fault hook.

mod hints;
mod landed;
mod pull;
mod serve;

pub(crate) use hints::GatherHints;

use crate::config::NodeConfig;
use crate::directory::DirClient;
use crate::fault::FaultHook;
use crate::protocol::PullMsg;
use crate::rpc::Rpc;
use crate::store::Store;
use crate::workers::Workers;
use crate::ObjectId;
use phalanx_transport::{NodeId, StreamId, Transport};
use pull::Inbound;

pub(crate) use landed::OnLanded;
pub(crate) use pull::Driver;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One pull as the receiver saw it.
#[derive(Debug, Clone)]
pub struct TransferRecord {
    pub id: ObjectId,
    pub source: NodeId,
    pub receiver: NodeId,
    /// Offset the pull started at (non-zero after a resume).
    pub from: u64,
    /// Bytes that arrived in this pull.
    pub bytes: u64,
    pub start: Instant,
    pub end: Instant,
    pub ok: bool,
}

/// One pull as the source served it.
#[derive(Debug, Clone)]
pub struct ServeRecord {
    pub id: ObjectId,
    pub source: NodeId,
    pub receiver: NodeId,
    pub bytes: u64,
    /// Of `bytes`, those written on as they landed by the thread that took them in (a copy
    /// still filling, forwarded without a hand-off: `serve.rs`).
    pub forwarded: u64,
    pub start: Instant,
    pub end: Instant,
}

/// What the transfer engine is handed by its node.
pub(crate) struct TransferDeps {
    pub cfg: NodeConfig,
    pub transport: Arc<dyn Transport>,
    pub store: Arc<Store>,
    pub rpc: Arc<Rpc>,
    pub dir: Arc<DirClient>,
    pub fault: Arc<FaultHook>,
    pub workers: Arc<Workers>,
}

pub(crate) struct Transfers {
    id: NodeId,
    cfg: NodeConfig,
    transport: Arc<dyn Transport>,
    store: Arc<Store>,
    rpc: Arc<Rpc>,
    dir: Arc<DirClient>,
    fault: Arc<FaultHook>,
    /// Where pulls are driven and served.
    workers: Arc<Workers>,
    // Receiver side.
    inbound: Mutex<HashMap<StreamId, Inbound>>,
    /// Pulls in `inbound` that no thread drives (`pull::LazyPull`).
    lazy: AtomicUsize,
    next_stream: AtomicU64,
    recv_log: Mutex<Vec<TransferRecord>>,
    /// EWMA of pull throughput, f64 bits.
    bandwidth_bits: AtomicU64,
    /// The fastest pull so far, in bytes/s (f64 bits; positive floats order as their bits).
    peak_bits: AtomicU64,
    // Source side.
    /// Cancel flags of the pulls this node serves, by (receiver, stream).
    serving: Mutex<HashMap<(NodeId, StreamId), Arc<AtomicBool>>>,
    /// Serves forwarded with no worker (`serve.rs`, `Transfers::serve_lazily`).
    lazy_serves: Mutex<HashMap<(NodeId, StreamId), Arc<serve::Forward>>>,
    /// Called where bytes of these objects land (`landed.rs`): forwarded serves
    /// (`serve.rs`), combining reduce tasks.
    watchers: Mutex<HashMap<ObjectId, Vec<Arc<dyn OnLanded>>>>,
    serve_log: Mutex<Vec<ServeRecord>>,
    /// Where this node fetches allreduce partitions from (`hints.rs`); its serves consult
    /// them too.
    hints: GatherHints,
}

impl Transfers {
    pub fn new(d: TransferDeps) -> Transfers {
        Transfers {
            id: d.rpc.id(),
            cfg: d.cfg,
            transport: d.transport,
            store: d.store,
            rpc: d.rpc,
            dir: d.dir,
            fault: d.fault,
            workers: d.workers,
            inbound: Mutex::new(HashMap::new()),
            lazy: AtomicUsize::new(0),
            next_stream: AtomicU64::new(crate::rpc::unpredictable_start()),
            recv_log: Mutex::new(Vec::new()),
            bandwidth_bits: AtomicU64::new(0),
            peak_bits: AtomicU64::new(0),
            serving: Mutex::new(HashMap::new()),
            lazy_serves: Mutex::new(HashMap::new()),
            watchers: Mutex::new(HashMap::new()),
            serve_log: Mutex::new(Vec::new()),
            hints: GatherHints::default(),
        }
    }

    /// Where this node fetches allreduce partitions from, as their coordinators said.
    pub fn hints(&self) -> &GatherHints {
        &self.hints
    }

    /// A message of the pull family from `from`.
    pub fn handle(self: &Arc<Self>, from: NodeId, msg: PullMsg) {
        match msg {
            PullMsg::Pull {
                id,
                stream,
                dst,
                from: offset,
            } => self.on_pull(from, id, stream, dst, offset),
            PullMsg::CancelPull { stream } => self.on_cancel(from, stream),
            PullMsg::PullEnd { stream, ok } => self.on_pull_end(from, stream, ok),
        }
    }

    /// `peer` died: pulls from it fail (and resume elsewhere), pulls it made stop.
    /// Adds to `peers` the sources of the pulls in progress here and the receivers served.
    pub fn peers_streaming(&self, peers: &mut std::collections::HashSet<NodeId>) {
        self.inbound_sources(peers);
        peers.extend(self.serving.lock().unwrap().keys().map(|(r, _)| *r));
    }

    pub fn on_peer_down(&self, peer: NodeId, reason: &str) {
        self.fail_inbound_from(peer, reason);
        self.cancel_serving_to(peer);
    }

    /// The node is closing: every pull in progress fails.
    pub fn close(&self) {
        self.fail_all_inbound();
    }

    /// Pulls this node received, in order.
    pub fn transfer_log(&self) -> Vec<TransferRecord> {
        self.recv_log.lock().unwrap().clone()
    }

    /// Pulls this node served, in order.
    pub fn serve_log(&self) -> Vec<ServeRecord> {
        self.serve_log.lock().unwrap().clone()
    }

    /// Observed pull throughput in bytes/s (or the configured override).
    /// The node's fault-injection hook (also applied to the blocks of halving-doubling
    /// allreduces this node sends).
    pub(crate) fn fault_hook(&self) -> &Arc<FaultHook> {
        &self.fault
    }

    pub fn bandwidth_estimate(&self) -> f64 {
        if let Some(b) = self.cfg.bandwidth_override {
            return b;
        }
        match f64::from_bits(self.bandwidth_bits.load(Ordering::Relaxed)) {
            b if b > 0.0 => b,
            _ => 1.25e9, // 10 Gbit/s until a pull has been measured
        }
    }

    /// What one link carries, in bytes/s: the fastest pull of 1 MiB or more so far (or the
    /// configured override; 10 Gbit/s until a pull has been measured). Pulls that share a
    /// link, or stream an object as it is made, go slower than it: the estimate above
    /// averages them, this one does not.
    pub fn link_bandwidth(&self) -> f64 {
        if let Some(b) = self.cfg.bandwidth_override {
            return b;
        }
        match f64::from_bits(self.peak_bits.load(Ordering::Relaxed)) {
            b if b > 0.0 => b,
            _ => 1.25e9,
        }
    }

    /// Folds one finished pull into the throughput estimate (pulls under 1 MiB are latency).
    fn record_throughput(&self, bytes: u64, secs: f64) {
        if bytes < (1 << 20) || secs <= 0.0 {
            return;
        }
        let sample = bytes as f64 / secs;
        self.peak_bits
            .fetch_max(sample.to_bits(), Ordering::Relaxed);
        let old = f64::from_bits(self.bandwidth_bits.load(Ordering::Relaxed));
        let new = if old > 0.0 {
            0.7 * old + 0.3 * sample
        } else {
            sample
        };
        self.bandwidth_bits.store(new.to_bits(), Ordering::Relaxed);
    }
}
