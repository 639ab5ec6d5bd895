//! `phalanx.Node`: one node of a cluster, and the object store API on it.

use crate::blocking;
use crate::buffer::{Borrowed, ObjectBuffer};
use crate::errors::{self, to_py};
use crate::reduce::{self, Claims, ReduceHandle, ReduceResult};
use crate::writer::ObjectWriter;
use phalanx::store::CopyStatus;
use phalanx::{ClusterConfig, ObjectId, ObjectView};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMemoryView};
use std::path::PathBuf;
use std::time::Duration;

/// A Phalanx node. `Node(config, id)` starts node `id` of the cluster described by the TOML
/// file `config` (the same files as the `phalanx` command) and waits for its peers;
/// `phalanx.local_cluster(n)` starts `n` nodes in this process.
#[pyclass(module = "phalanx", frozen)]
pub struct Node {
    pub(crate) node: phalanx::Node,
}

impl Node {
    pub fn wrap(node: phalanx::Node) -> Node {
        Node { node }
    }
}

/// A memoryview over an object's bytes.
fn memoryview<'py>(
    py: Python<'py>,
    name: &str,
    bytes: ObjectView,
) -> PyResult<Bound<'py, PyMemoryView>> {
    let buf = Bound::new(py, ObjectBuffer::new(name.to_owned(), bytes)?)?;
    PyMemoryView::from(buf.as_any())
}

impl Node {
    /// The complete object, waiting for it (interruptibly) unless a complete copy is here.
    fn view(
        &self,
        py: Python<'_>,
        name: &str,
        timeout: Option<f64>,
        source: Option<u32>,
    ) -> PyResult<ObjectView> {
        blocking::deadline(timeout)?; // a bad timeout is refused even when it is not needed
        let id = ObjectId::new(name);
        let here = self
            .node
            .local_copy(id.clone())
            .is_some_and(|c| c.status == CopyStatus::Complete);
        if here {
            // A complete local copy: no peer to wait for.
            let node = &self.node;
            if let Ok(v) = py.detach(|| node.get_view(id.clone())) {
                return Ok(v);
            }
        }
        if let Some(src) = source {
            if src >= self.node.num_nodes() {
                return Err(errors::InvalidArgument::new_err(format!(
                    "source {src} is not a node of this {}-node cluster",
                    self.node.num_nodes()
                )));
            }
        }
        let node = self.node.clone();
        // With a timeout the library gives up by itself (its lookup withdrawn, no pooled
        // thread left waiting); the caller's own deadline, a little later, is the backstop.
        let limit = timeout.map(|t| Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX));
        let backstop = timeout.map(|t| t + 0.5);
        let what = format!("object {name}");
        blocking::run(py, backstop, &what, move || match (source, limit) {
            (Some(src), _) => node.get_view_from(id, src),
            (None, Some(t)) => node.get_view_timeout(id, t),
            (None, None) => node.get_view(id),
        })
    }

    /// An error unless `coordinator` is a node of the cluster.
    fn check_coordinator(&self, coordinator: u32) -> PyResult<()> {
        if coordinator >= self.node.num_nodes() {
            return Err(errors::InvalidArgument::new_err(format!(
                "coordinator {coordinator} is not a node of this {}-node cluster",
                self.node.num_nodes()
            )));
        }
        Ok(())
    }

    /// The coordinator's side of an allreduce into `target`: `run` (with this node, the
    /// target, the sources and the options of `degree`) on a pooled thread, interruptibly.
    fn coordinate(
        &self,
        py: Python<'_>,
        (target, sources): (&str, &[String]),
        degree: Option<usize>,
        timeout: Option<f64>,
        run: impl FnOnce(
                phalanx::Node,
                ObjectId,
                Vec<ObjectId>,
                phalanx::ReduceOptions,
            ) -> phalanx::Result<(ObjectView, phalanx::ReduceOutcome)>
            + Send
            + 'static,
    ) -> PyResult<(ObjectView, phalanx::ReduceOutcome)> {
        let opts = reduce::options(degree, None, None, None)?;
        let (node, id, srcs) = (
            self.node.clone(),
            ObjectId::new(target),
            reduce::ids(sources),
        );
        let what = format!("allreduce into {target}");
        blocking::run(py, timeout, &what, move || run(node, id, srcs, opts))
    }
}

#[pymethods]
impl Node {
    #[new]
    #[pyo3(signature = (config, id=None, rejoin=false, timeout=None))]
    fn new(
        py: Python<'_>,
        config: PathBuf,
        id: Option<u32>,
        rejoin: bool,
        timeout: Option<f64>,
    ) -> PyResult<Node> {
        let cfg = ClusterConfig::load(&config).map_err(to_py)?;
        let id = match id {
            Some(id) => id,
            None => phalanx::cluster::rank_from_env().map_err(to_py)?,
        };
        let what = format!("node {id}'s peers ({})", config.display());
        let node = blocking::run(py, timeout, &what, move || {
            phalanx::cluster::start_node(&cfg, id, rejoin)
        })?;
        Ok(Node { node })
    }

    /// This node's id (its rank in the cluster).
    #[getter]
    fn id(&self) -> u32 {
        self.node.id()
    }

    /// Number of nodes in the cluster.
    #[getter]
    fn num_nodes(&self) -> u32 {
        self.node.num_nodes()
    }

    /// Stores an immutable object: the bytes of `data` (anything with the buffer protocol:
    /// bytes, bytearray, memoryview, a C-contiguous NumPy array) are copied once into the
    /// arena. Objects under 64 KiB also travel inline with the directory entry.
    fn put(&self, py: Python<'_>, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = Borrowed::new(data, false)?;
        let bytes = b.bytes();
        let node = &self.node;
        py.detach(|| node.put(name, bytes)).map_err(to_py)
    }

    /// Starts an object of `size` bytes written in place in this node's arena, where its
    /// readers will read it: `np.frombuffer(writer, dtype)` is a writable array over its
    /// bytes (no copy, where `put` copies its argument in). Fill it, drop every view of it,
    /// and `seal` the writer (or use it as a context manager: sealed on exit, aborted on an
    /// exception). `write(data)` copies bytes in instead; `announce()` and `commit(n)`
    /// stream the object to readers while it is written. Raises `AlreadyExists` if this
    /// node holds `name` already, `OutOfMemory` if the arena has no room.
    fn create(&self, name: &str, size: u64) -> PyResult<ObjectWriter> {
        let w = self.node.create(name, size).map_err(to_py)?;
        Ok(ObjectWriter::new(name.to_owned(), size, w))
    }

    /// The object's bytes as a read-only memoryview, waiting for the object to be put. A
    /// copy in the arena is shared, not copied (`np.frombuffer(view, dtype)` makes a NumPy
    /// array of it, also without a copy); it stays valid while referenced, even after
    /// `delete`. Raises `phalanx.Timeout` after `timeout` seconds. `source` pulls only from
    /// that node (no broadcast tree: the star baseline of a task system without collectives).
    #[pyo3(signature = (name, timeout=None, source=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        timeout: Option<f64>,
        source: Option<u32>,
    ) -> PyResult<Bound<'py, PyMemoryView>> {
        let v = self.view(py, name, timeout, source)?;
        memoryview(py, name, v)
    }

    /// Like `get`, returning the `ObjectBuffer` itself (its `address`, `in_arena`).
    #[pyo3(signature = (name, timeout=None, source=None))]
    fn get_buffer(
        &self,
        py: Python<'_>,
        name: &str,
        timeout: Option<f64>,
        source: Option<u32>,
    ) -> PyResult<Py<ObjectBuffer>> {
        let v = self.view(py, name, timeout, source)?;
        Py::new(py, ObjectBuffer::new(name.to_owned(), v)?)
    }

    /// Copies the object into `out` (a writable buffer at least as large) and returns its
    /// size in bytes.
    #[pyo3(signature = (name, out, timeout=None))]
    fn get_into(
        &self,
        py: Python<'_>,
        name: &str,
        out: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<usize> {
        let mut dst = Borrowed::new(out, true)?;
        let v = self.view(py, name, timeout, None)?;
        let src: &[u8] = &v;
        if src.len() > dst.len() {
            return Err(errors::InvalidArgument::new_err(format!(
                "object {name} has {} bytes; the output buffer only {}",
                src.len(),
                dst.len()
            )));
        }
        let d = &mut dst.bytes_mut()[..src.len()];
        py.detach(|| d.copy_from_slice(src));
        Ok(src.len())
    }

    /// Deletes the object from every node and from the directory. Views already handed out
    /// stay valid.
    fn delete(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let node = self.node.clone();
        let id = ObjectId::new(name);
        blocking::run(py, None, &format!("deleting {name}"), move || {
            node.delete(id)
        })
    }

    /// Drops this node's copy unless it is a pinned `put` copy; returns whether one was
    /// dropped.
    fn evict_local(&self, name: &str) -> bool {
        self.node.evict_local(name)
    }

    /// Whether a complete copy of the object is on this node.
    fn has_local(&self, name: &str) -> bool {
        self.node
            .local_copy(name)
            .is_some_and(|c| c.status == CopyStatus::Complete)
    }

    /// Reduces the first `n` (default: all) of `sources` to become ready into `target`
    /// with `op` ("sum", "min", "max", "prod") over elements of `dtype` (a name or a NumPy
    /// dtype). Returns a `ReduceResult` whose `used` lists the inputs combined. `required`
    /// sources are always used; `claims` is shared by concurrent reduces over overlapping
    /// sources.
    #[pyo3(signature = (target, sources, n=None, op="sum", dtype=None, degree=None, required=None, claims=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        target: &str,
        sources: Vec<String>,
        n: Option<usize>,
        op: &str,
        dtype: Option<&Bound<'_, PyAny>>,
        degree: Option<usize>,
        required: Option<Vec<String>>,
        claims: Option<PyRef<'_, Claims>>,
        timeout: Option<f64>,
    ) -> PyResult<Py<ReduceResult>> {
        let (op, dt, opts, n) =
            reduce_args(&sources, n, op, dtype, degree, required, claims, timeout)?;
        let (node, target, srcs) = (
            self.node.clone(),
            ObjectId::new(target),
            reduce::ids(&sources),
        );
        let what = format!("reduce into {target}");
        let o = blocking::run(py, None, &what, move || {
            node.reduce_with(target, &srcs, n, op, dt, &opts)
        })?;
        Py::new(py, ReduceResult::from(o))
    }

    /// Starts a reduce (same arguments as `reduce`) and returns a `ReduceHandle` at once:
    /// `handle.inputs()` names the inputs as soon as the tree is full, `handle.wait()` the
    /// result.
    #[pyo3(signature = (target, sources, n=None, op="sum", dtype=None, degree=None, required=None, claims=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_start(
        &self,
        target: &str,
        sources: Vec<String>,
        n: Option<usize>,
        op: &str,
        dtype: Option<&Bound<'_, PyAny>>,
        degree: Option<usize>,
        required: Option<Vec<String>>,
        claims: Option<PyRef<'_, Claims>>,
        timeout: Option<f64>,
    ) -> PyResult<ReduceHandle> {
        let (op, dt, opts, n) =
            reduce_args(&sources, n, op, dtype, degree, required, claims, timeout)?;
        let h = self
            .node
            .reduce_start(target, reduce::ids(&sources), n, op, dt, opts)
            .map_err(to_py)?;
        Ok(ReduceHandle::new(h))
    }

    /// Allreduce of `sources` into `target`, called by every participant (SPMD): the node
    /// `coordinator` runs the reduce, every other one reads `target` while it is still being
    /// reduced. Returns the result's bytes on every caller.
    #[pyo3(signature = (target, sources, op="sum", dtype=None, coordinator=0, degree=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce<'py>(
        &self,
        py: Python<'py>,
        target: &str,
        sources: Vec<String>,
        op: &str,
        dtype: Option<&Bound<'_, PyAny>>,
        coordinator: u32,
        degree: Option<usize>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyMemoryView>> {
        let (op, dt) = (reduce::parse_op(op)?, dtype_or_f32(dtype)?);
        self.check_coordinator(coordinator)?;
        if self.node.id() != coordinator {
            // The size, from an input held here: a partitioned allreduce (nodes configured
            // with `allreduce_partition_min`) is assembled here from its partitions.
            let size = sources
                .iter()
                .find_map(|s| self.node.local_copy(s.as_str()).map(|c| c.size));
            let Some(size) = size else {
                return self.get(py, target, timeout, None);
            };
            let (node, id) = (self.node.clone(), ObjectId::new(target));
            let what = format!("allreduce into {target}");
            let v = blocking::run(py, timeout, &what, move || node.allreduce_read(id, size))?;
            return memoryview(py, target, v);
        }
        let (view, _) = self.coordinate(
            py,
            (target, &sources),
            degree,
            timeout,
            move |node, id, srcs, opts| node.allreduce_view(id, &srcs, op, dt, &opts),
        )?;
        memoryview(py, target, view)
    }

    /// Allreduce of the first `n` of `sources` to become ready (in arrival order, as `reduce`
    /// with `n` places them), called by every participant (SPMD): the node `coordinator`
    /// runs one reduce tree, every other one reads `target` while it is being reduced.
    /// Returns `(result, used)`: the result's bytes on every caller, and on the coordinator
    /// the names of the `n` inputs combined (`None` elsewhere: a reader knows only that `n`
    /// were). `n` of at least `len(sources)` is a whole `allreduce`.
    #[pyo3(signature = (target, sources, n, op="sum", dtype=None, coordinator=0, degree=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce_first<'py>(
        &self,
        py: Python<'py>,
        target: &str,
        sources: Vec<String>,
        n: usize,
        op: &str,
        dtype: Option<&Bound<'_, PyAny>>,
        coordinator: u32,
        degree: Option<usize>,
        timeout: Option<f64>,
    ) -> PyResult<(Bound<'py, PyMemoryView>, Option<Vec<String>>)> {
        let (op, dt) = (reduce::parse_op(op)?, dtype_or_f32(dtype)?);
        if n == 0 || sources.is_empty() {
            return Err(errors::InvalidArgument::new_err(format!(
                "allreduce of the first {n} of {} inputs",
                sources.len()
            )));
        }
        self.check_coordinator(coordinator)?;
        if self.node.id() != coordinator {
            let view =
                self.allreduce(py, target, sources, "sum", None, coordinator, None, timeout)?;
            return Ok((view, None));
        }
        let (view, outcome) = self.coordinate(
            py,
            (target, &sources),
            degree,
            timeout,
            move |node, id, srcs, opts| node.allreduce_first(id, &srcs, n, op, dt, &opts),
        )?;
        let used = outcome.used.iter().map(|s| s.as_str().to_owned()).collect();
        Ok((memoryview(py, target, view)?, Some(used)))
    }

    /// The objects `names`, fetched concurrently (a gather at this node), as memoryviews in
    /// the same order.
    #[pyo3(signature = (names, timeout=None))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        names: Vec<String>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyMemoryView>>> {
        let (node, ids) = (self.node.clone(), reduce::ids(&names));
        let what = format!("gather of {} objects", names.len());
        let all = blocking::run(py, timeout, &what, move || node.gather(&ids))?;
        names
            .iter()
            .zip(all)
            .map(|(n, b)| memoryview(py, n, ObjectView::Owned(b)))
            .collect()
    }

    /// Whether node `peer` is up, as far as this node knows (itself always is).
    fn is_alive(&self, peer: u32) -> bool {
        peer == self.node.id() || self.node.transport().is_up(peer)
    }

    /// The node's arena: (base address, length in bytes).
    fn arena_range(&self) -> (usize, usize) {
        self.node.arena_range()
    }

    /// Free bytes of the arena.
    fn arena_free(&self) -> u64 {
        self.node.arena_free()
    }

    /// The transport's counters (messages, data bytes, registrations, peers down, refused
    /// writes and hellos).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.node.transport_stats();
        let d = PyDict::new(py);
        d.set_item("transport", self.node.transport().name())?;
        d.set_item("ctrl_sent", s.ctrl_sent)?;
        d.set_item("ctrl_received", s.ctrl_received)?;
        d.set_item("data_bytes_sent", s.data_bytes_sent)?;
        d.set_item("data_bytes_received", s.data_bytes_received)?;
        d.set_item("payload_bytes_copied", s.payload_bytes_copied)?;
        d.set_item("registrations", s.registrations)?;
        d.set_item("peers_down", s.peers_down)?;
        d.set_item("malformed_frames", s.malformed_frames)?;
        d.set_item("hellos_refused", s.hellos_refused)?;
        d.set_item("grant_registrations", s.grant_registrations)?;
        Ok(d)
    }

    /// Whether the node is shut down (or was killed).
    #[getter]
    fn closed(&self) -> bool {
        self.node.is_closed()
    }

    /// Stops the node: its links close, its peers see it leave.
    fn shutdown(&self, py: Python<'_>) {
        let node = &self.node;
        py.detach(|| node.shutdown());
    }

    /// Stops the node abruptly, as a crash would (for fault tests).
    fn kill(&self, py: Python<'_>) {
        let node = &self.node;
        py.detach(|| node.kill());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.shutdown(py);
    }

    fn __repr__(&self) -> String {
        format!(
            "<phalanx.Node {} of {} ({})>",
            self.node.id(),
            self.node.num_nodes(),
            self.node.transport().name()
        )
    }
}

/// The keyword arguments `reduce` and `reduce_start` share, checked: op, dtype, options and
/// how many sources to use (default: all).
#[allow(clippy::too_many_arguments)]
fn reduce_args(
    sources: &[String],
    n: Option<usize>,
    op: &str,
    dtype: Option<&Bound<'_, PyAny>>,
    degree: Option<usize>,
    required: Option<Vec<String>>,
    claims: Option<PyRef<'_, Claims>>,
    timeout: Option<f64>,
) -> PyResult<(
    phalanx::ReduceOp,
    phalanx::DType,
    phalanx::ReduceOptions,
    usize,
)> {
    let (op, dt) = (reduce::parse_op(op)?, dtype_or_f32(dtype)?);
    let opts = reduce::options(degree, timeout, required, claims.as_deref())?;
    Ok((op, dt, opts, n.unwrap_or(sources.len())))
}

fn dtype_or_f32(dtype: Option<&Bound<'_, PyAny>>) -> PyResult<phalanx::DType> {
    match dtype {
        Some(d) => reduce::parse_dtype(d),
        None => Ok(phalanx::DType::F32),
    }
}
