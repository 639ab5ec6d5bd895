//! `phalanx.local_cluster(n)`: n nodes in this process, linked over loopback.

use crate::blocking;
use crate::errors::{self, to_py};
use crate::node::Node;
use phalanx::transport::TcpConfig;
use phalanx::{LocalCluster, NodeConfig};
use pyo3::prelude::*;
use std::sync::Mutex;

/// Nodes started together in this process (tests, notebooks, one-machine runs). Shut down
/// by `shutdown()`, at the end of a `with` block, or when garbage collected.
#[pyclass(module = "phalanx", name = "LocalCluster", frozen)]
pub struct PyLocalCluster {
    cluster: Mutex<Option<LocalCluster>>,
    nodes: Vec<Py<Node>>,
}

/// Starts `n` nodes in this process over TCP on 127.0.0.1. `lost_after` (seconds): how long
/// an object whose every copy died is waited for before its readers get `ObjectLost`.
#[pyfunction]
#[pyo3(signature = (n, arena_size=1<<30, op_timeout=60.0, chunk_size=None, spin_wait_us=None, lost_after=None))]
pub fn local_cluster(
    py: Python<'_>,
    n: u32,
    arena_size: u64,
    op_timeout: f64,
    chunk_size: Option<u64>,
    spin_wait_us: Option<u64>,
    lost_after: Option<f64>,
) -> PyResult<PyLocalCluster> {
    if n == 0 {
        return Err(errors::InvalidArgument::new_err(
            "a cluster needs at least one node",
        ));
    }
    let d = NodeConfig::default();
    let cfg = NodeConfig {
        arena_size,
        op_timeout: blocking::duration(op_timeout, "op_timeout")?,
        chunk_size: chunk_size.unwrap_or(d.chunk_size),
        spin_wait: spin_wait_us.map_or(d.spin_wait, std::time::Duration::from_micros),
        lost_after: match lost_after {
            Some(s) => blocking::duration(s, "lost_after")?,
            None => d.lost_after,
        },
        ..d
    };
    let c = py
        .detach(|| LocalCluster::start(n, cfg, TcpConfig::default()))
        .map_err(to_py)?;
    let nodes = (0..n as usize)
        .map(|i| Py::new(py, Node::wrap(c.node(i).clone())))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyLocalCluster {
        cluster: Mutex::new(Some(c)),
        nodes,
    })
}

#[pymethods]
impl PyLocalCluster {
    fn __len__(&self) -> usize {
        self.nodes.len()
    }

    fn __getitem__(&self, py: Python<'_>, i: isize) -> PyResult<Py<Node>> {
        let n = self.nodes.len() as isize;
        let k = if i < 0 { i + n } else { i };
        if !(0..n).contains(&k) {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "node {i} of a {n}-node cluster"
            )));
        }
        Ok(self.nodes[k as usize].clone_ref(py))
    }

    /// The nodes, by id.
    #[getter]
    fn nodes(&self, py: Python<'_>) -> Vec<Py<Node>> {
        self.nodes.iter().map(|n| n.clone_ref(py)).collect()
    }

    /// Stops every node (idempotent).
    fn shutdown(&self, py: Python<'_>) {
        let c = self.cluster.lock().unwrap().take();
        if let Some(c) = c {
            py.detach(move || drop(c));
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.shutdown(py);
    }

    fn __repr__(&self) -> String {
        format!("<phalanx.LocalCluster of {} nodes>", self.nodes.len())
    }
}
