//! Reduce from Python: the op and dtype names, options, the outcome, a handle on a reduce
//! running in the background, and the claims pool concurrent reduces share.

use crate::blocking;
use crate::errors::{self, to_py};
use phalanx::{DType, ObjectId, ReduceOp, ReduceOptions, ReduceOutcome, SourceClaims};
use pyo3::prelude::*;
use pyo3::types::PyString;
use std::sync::{Arc, Mutex};

pub fn parse_op(op: &str) -> PyResult<ReduceOp> {
    match op.to_ascii_lowercase().as_str() {
        "sum" => Ok(ReduceOp::Sum),
        "min" => Ok(ReduceOp::Min),
        "max" => Ok(ReduceOp::Max),
        "prod" | "product" => Ok(ReduceOp::Prod),
        _ => Err(errors::InvalidArgument::new_err(format!(
            "unknown reduce op {op:?} (sum, min, max, prod)"
        ))),
    }
}

/// A dtype given as a name ("float32", "f32") or as anything `numpy.dtype` accepts
/// (`np.float32`, `np.dtype("<f4")`, an array's `.dtype`).
pub fn parse_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<DType> {
    let name: String = if let Ok(s) = dtype.cast::<PyString>() {
        s.to_str()?.to_owned()
    } else {
        let np = dtype.py().import("numpy").map_err(|_| {
            errors::InvalidArgument::new_err(
                "dtype: pass a name such as \"float32\" (numpy is not installed)",
            )
        })?;
        np.getattr("dtype")?
            .call1((dtype,))?
            .getattr("name")?
            .extract()?
    };
    match name.as_str() {
        "float32" | "f32" | "<f4" | "f4" => Ok(DType::F32),
        "float64" | "f64" | "<f8" | "f8" => Ok(DType::F64),
        "int32" | "i32" | "<i4" | "i4" => Ok(DType::I32),
        "int64" | "i64" | "<i8" | "i8" => Ok(DType::I64),
        "uint8" | "u8" | "|u1" | "u1" => Ok(DType::U8),
        _ => Err(errors::InvalidArgument::new_err(format!(
            "dtype {name:?} is not supported (float32, float64, int32, int64, uint8)"
        ))),
    }
}

pub fn ids(names: &[String]) -> Vec<ObjectId> {
    names.iter().map(|n| ObjectId::new(n.as_str())).collect()
}

/// The options of a reduce, from Python's keyword arguments.
pub fn options(
    degree: Option<usize>,
    timeout: Option<f64>,
    required: Option<Vec<String>>,
    claims: Option<&Claims>,
) -> PyResult<ReduceOptions> {
    if degree == Some(0) {
        return Err(errors::InvalidArgument::new_err(
            "degree must be at least 1",
        ));
    }
    Ok(ReduceOptions {
        degree,
        timeout: timeout
            .map(|t| blocking::duration(t, "timeout"))
            .transpose()?,
        required: ids(&required.unwrap_or_default()),
        claims: claims.map(|c| c.pool.clone()),
        ..ReduceOptions::default()
    })
}

/// What a reduce did.
#[pyclass(module = "phalanx", frozen, get_all)]
pub struct ReduceResult {
    /// The object the result was written to.
    pub target: String,
    /// The sources combined, in the order they became ready.
    pub used: Vec<String>,
    /// The degree of the reduce tree.
    pub degree: usize,
    /// Tree positions computed again because a failure touched them.
    pub recomputed: Vec<usize>,
    /// Seconds from the start of the reduce to its end.
    pub latency_s: f64,
    /// Result bytes per second over that time.
    pub bandwidth_bps: f64,
}

impl From<ReduceOutcome> for ReduceResult {
    fn from(o: ReduceOutcome) -> Self {
        ReduceResult {
            target: o.target.as_str().to_owned(),
            used: o.used.iter().map(|i| i.as_str().to_owned()).collect(),
            degree: o.degree,
            recomputed: o.recomputed,
            latency_s: o.latency_s,
            bandwidth_bps: o.bandwidth_bps,
        }
    }
}

#[pymethods]
impl ReduceResult {
    fn __repr__(&self) -> String {
        format!(
            "ReduceResult(target={:?}, used={:?}, degree={}, latency_s={:.6})",
            self.target, self.used, self.degree, self.latency_s
        )
    }
}

/// A pool of claims shared by concurrent reduces over overlapping sources: a source one of
/// them used is never used by another.
#[pyclass(module = "phalanx", frozen)]
pub struct Claims {
    pool: Arc<SourceClaims>,
}

#[pymethods]
impl Claims {
    #[new]
    fn new() -> Self {
        Claims {
            pool: SourceClaims::new(),
        }
    }

    /// Forgets `name`'s claim (once no reduce in flight could still pick it).
    fn forget(&self, name: &str) {
        self.pool.forget(&ObjectId::new(name));
    }

    /// The target of the reduce that claimed `name`, if any.
    fn owner(&self, name: &str) -> Option<String> {
        self.pool
            .owner_of(&ObjectId::new(name))
            .map(|o| o.as_str().to_owned())
    }
}

/// A reduce running in the background (`Node.reduce_start`).
#[pyclass(module = "phalanx", frozen)]
pub struct ReduceHandle {
    handle: phalanx::ReduceHandle,
    /// The placed inputs, once heard (the handle says them once).
    inputs: Mutex<Option<Option<Vec<String>>>>,
    /// The outcome, once heard.
    outcome: Mutex<Option<PyResult<Py<ReduceResult>>>>,
}

impl ReduceHandle {
    pub fn new(handle: phalanx::ReduceHandle) -> Self {
        ReduceHandle {
            handle,
            inputs: Mutex::new(None),
            outcome: Mutex::new(None),
        }
    }
}

#[pymethods]
impl ReduceHandle {
    /// The inputs the reduce placed, in arrival order, once every position of its tree has
    /// one (long before the result is complete). `None` if the reduce ended first or if
    /// `timeout` passed.
    #[pyo3(signature = (timeout=None))]
    fn inputs(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Vec<String>>> {
        if let Some(known) = self.inputs.lock().unwrap().clone() {
            return Ok(known);
        }
        let got = blocking::wait_sliced(py, blocking::deadline(timeout)?, |slice| {
            if let Some(v) = self.handle.inputs_timeout(slice) {
                return Some(Some(v));
            }
            // Ended without placing them: say so instead of waiting.
            self.handle.is_finished().then_some(None)
        })?;
        let Some(got) = got else { return Ok(None) };
        let names = got.map(|v| v.iter().map(|i| i.as_str().to_owned()).collect::<Vec<_>>());
        *self.inputs.lock().unwrap() = Some(names.clone());
        Ok(names)
    }

    /// Whether the reduce has finished.
    fn done(&self) -> bool {
        self.outcome.lock().unwrap().is_some() || self.handle.is_finished()
    }

    /// Waits for the reduce to finish and returns what it did; raises its error, or
    /// `phalanx.Timeout` when `timeout` seconds pass first (the reduce goes on).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<ReduceResult>> {
        if let Some(r) = self.known(py) {
            return r;
        }
        let deadline = blocking::deadline(timeout)?;
        let got = blocking::wait_sliced(py, deadline, |slice| self.handle.wait_timeout(slice))?;
        let Some(r) = got else {
            return Err(errors::Timeout::new_err(format!(
                "the reduce did not finish within {} s",
                timeout.unwrap_or_default()
            )));
        };
        let stored = match r {
            Ok(o) => Py::new(py, ReduceResult::from(o)),
            Err(e) => Err(to_py(e)),
        };
        *self.outcome.lock().unwrap() = Some(stored);
        self.known(py).expect("stored above")
    }
}

impl ReduceHandle {
    /// The outcome heard earlier, if any (an error is raised again, same class).
    fn known(&self, py: Python<'_>) -> Option<PyResult<Py<ReduceResult>>> {
        let slot = self.outcome.lock().unwrap();
        slot.as_ref().map(|r| match r {
            Ok(v) => Ok(v.clone_ref(py)),
            Err(e) => Err(e.clone_ref(py)),
        })
    }
}
