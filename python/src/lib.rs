//! The `phalanx._native` extension module: Phalanx's object store API for Python. The
//! `phalanx` package re-exports it (python/pysrc/phalanx/__init__.py).
//!
//! Files: `node.rs` the Node and its calls, `cluster.rs` local clusters, `reduce.rs` reduce
//! options, outcome and handles, `buffer.rs` zero-copy views out and borrowed buffers in,
//! `writer.rs` objects written in place,
//! `blocking.rs` GIL-free interruptible waits, `bench.rs` the Rust side of the overhead benchmark, `errors.rs` the exception classes.

mod bench;
mod blocking;
mod buffer;
mod cluster;
mod errors;
mod node;
mod reduce;
mod writer;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<node::Node>()?;
    m.add_class::<cluster::PyLocalCluster>()?;
    m.add_class::<buffer::ObjectBuffer>()?;
    m.add_class::<writer::ObjectWriter>()?;
    m.add_class::<reduce::ReduceResult>()?;
    m.add_class::<reduce::ReduceHandle>()?;
    m.add_class::<reduce::Claims>()?;
    m.add_function(wrap_pyfunction!(cluster::local_cluster, m)?)?;
    m.add_function(wrap_pyfunction!(bench::bench_rust_get, m)?)?;
    m.add("INLINE_LIMIT", phalanx::INLINE_LIMIT)?;
    errors::register(m)?;
    Ok(())
}
