//! The Rust side of `python/bench/get_overhead.py`: the same get loop as the Python side,
//! run from Rust in the same process, so the two are compared in one run.

use crate::errors::to_py;
use crate::node::Node;
use pyo3::prelude::*;
use std::time::Instant;

/// `putter` puts `iters` objects of `size` bytes one after another; `getter` gets each one
/// (`Node::get_view`, as `Node.get` does) and drops it; the object is then deleted. Returns
/// the seconds each get took.
#[pyfunction]
pub fn bench_rust_get(
    py: Python<'_>,
    putter: PyRef<'_, Node>,
    getter: PyRef<'_, Node>,
    size: usize,
    iters: usize,
    prefix: &str,
) -> PyResult<Vec<f64>> {
    let (src, dst) = (putter.node.clone(), getter.node.clone());
    let payload: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
    py.detach(|| {
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            let name = format!("{prefix}/{i}");
            src.put(name.as_str(), &payload)?;
            let t = Instant::now();
            let v = dst.get_view(name.as_str())?;
            times.push(t.elapsed().as_secs_f64());
            if v.len() != size {
                return Err(phalanx::Error::InvalidArgument(format!(
                    "got {} bytes of {size}",
                    v.len()
                )));
            }
            drop(v);
            src.delete(name.as_str())?;
        }
        Ok(times)
    })
    .map_err(to_py)
}
