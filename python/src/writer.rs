//! `phalanx.ObjectWriter`: an object written in place in the node's arena (`Node.create`).
//! The writer exports the object's unwritten bytes as a writable buffer, so a NumPy array
//! over them is filled where readers will read it: no copy, where `put` copies its argument
//! in. While any view of that buffer is alive the writer refuses to move on (`write`,
//! `commit`, `seal`, `abort`: `BufferError`), so the bytes readers may read are never the
//! ones Python can still write.

use crate::buffer::Borrowed;
use crate::errors::{self, to_py};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_int, c_void};

/// An object being written in this node's arena. See `Node.create`.
#[pyclass(module = "phalanx")]
pub struct ObjectWriter {
    name: String,
    size: u64,
    /// `None` once sealed or aborted.
    writer: Option<phalanx::ObjectWriter>,
    /// Buffers exported and not released yet.
    exports: usize,
    /// The unwritten bytes were handed out to be written in place: `seal` takes them as
    /// written.
    exported: bool,
    sealed: bool,
}

impl ObjectWriter {
    pub fn new(name: String, size: u64, writer: phalanx::ObjectWriter) -> ObjectWriter {
        ObjectWriter {
            name,
            size,
            writer: Some(writer),
            exports: 0,
            exported: false,
            sealed: false,
        }
    }

    /// The writer, unless sealed or aborted, and no view of its bytes is alive.
    fn open(&mut self, what: &str) -> PyResult<&mut phalanx::ObjectWriter> {
        if self.exports > 0 {
            return Err(PyBufferError::new_err(format!(
                "cannot {what} {}: {} view(s) of its bytes still exported (release them first)",
                self.name, self.exports
            )));
        }
        self.writer.as_mut().ok_or_else(|| {
            errors::InvalidArgument::new_err(format!("{} is sealed or aborted", self.name))
        })
    }
}

#[pymethods]
impl ObjectWriter {
    /// Exports the bytes not written yet (all of them at first) writable, format "B": fill
    /// them in place (`np.frombuffer(writer, dtype)` is a writable array over them), then
    /// release every view and `seal`, or `commit` a prefix to stream it to readers first.
    ///
    /// # Safety
    /// Called by the interpreter with a valid `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (at, len) = {
            // Busy (another thread in `seal` or `write`, the GIL released): refused.
            let mut me = slf
                .try_borrow_mut()
                .map_err(|_| PyBufferError::new_err("the writer is busy in another thread"))?;
            let name = me.name.clone();
            let w = me.writer.as_mut().ok_or_else(|| {
                PyBufferError::new_err(format!("{name} is sealed or aborted: nothing to write"))
            })?;
            let (at, len) = w.unwritten().map_err(to_py)?;
            me.exports += 1;
            me.exported = true;
            (at, len)
        };
        // A zero-length buffer still needs a valid, non-null address (`at` is one).
        // SAFETY: `view` comes from the interpreter; FillInfo takes a new reference on `slf`,
        // which keeps the writer, and so the `len` bytes at `at`, allocated until the view is
        // released; nothing else writes those bytes, and nobody reads them, until the writer
        // commits them, which it refuses while this export is counted (`exports`).
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                at.as_ptr() as *mut c_void,
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == -1 {
            slf.borrow_mut().exports -= 1;
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// A view of the bytes is released.
    ///
    /// # Safety
    /// Called by the interpreter once per view this writer exported.
    unsafe fn __releasebuffer__(&mut self, _view: *mut ffi::Py_buffer) {
        self.exports = self.exports.saturating_sub(1);
    }

    /// Copies `data` (any buffer) in after what is written so far; with `announce`d
    /// readers it streams to them at once.
    fn write(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = Borrowed::new(data, false)?;
        let bytes = b.bytes();
        let w = self.open("write to")?;
        py.detach(|| w.write(bytes)).map_err(to_py)
    }

    /// Takes the first `nbytes` of the bytes written in place (through the buffer) as the
    /// object's: announced readers are sent them now. No view of the buffer may be alive
    /// (release them, write on through a new one).
    fn commit(&mut self, nbytes: u64) -> PyResult<()> {
        self.open("commit")?.commit(nbytes).map_err(to_py)
    }

    /// Announces the object partial: readers on other nodes start now and stream its bytes
    /// as they are written or committed (objects under `INLINE_LIMIT` are announced at the
    /// seal, with their bytes).
    fn announce(&mut self, py: Python<'_>) -> PyResult<()> {
        let w = self.open("announce")?;
        py.detach(|| w.announce()).map_err(to_py)
    }

    /// Announces the object complete; readers get it from here. Bytes handed out through
    /// the buffer and not committed are taken as written (uninitialised bytes, as in
    /// `np.empty`, if the caller left them so); otherwise every byte must have been written.
    /// No view of the buffer may be alive. A writer that fails to seal has its copy taken
    /// back.
    fn seal(&mut self, py: Python<'_>) -> PyResult<()> {
        self.open("seal")?;
        let mut w = self.writer.take().expect("open");
        let rest = self.size - w.written();
        if self.exported && rest > 0 {
            w.commit(rest).map_err(to_py)?;
        }
        py.detach(move || w.seal()).map_err(to_py)?;
        self.sealed = true;
        Ok(())
    }

    /// Gives the object up: its copy, and any announcement, are taken back; the name is
    /// free again on this node. No view of the buffer may be alive.
    fn abort(&mut self) -> PyResult<()> {
        self.open("abort")?;
        self.writer = None;
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Seals on a normal exit (unless sealed or aborted already), aborts on an exception.
    fn __exit__(
        &mut self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.writer.is_none() {
            return Ok(false);
        }
        match exc_type {
            None => self.seal(py)?,
            Some(_) => {
                // Views still alive (the exception left them): taken back when the writer
                // is collected, after them.
                let _ = self.abort();
            }
        }
        Ok(false)
    }

    /// The object's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The object's size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }

    /// Bytes written (or committed) so far.
    #[getter]
    fn written(&self) -> u64 {
        match &self.writer {
            Some(w) => w.written(),
            None if self.sealed => self.size,
            None => 0,
        }
    }

    /// Whether it was sealed or aborted.
    #[getter]
    fn closed(&self) -> bool {
        self.writer.is_none()
    }

    /// Whether it was sealed (complete and readable from other nodes).
    #[getter]
    fn sealed(&self) -> bool {
        self.sealed
    }

    fn __len__(&self) -> usize {
        self.size as usize
    }

    fn __repr__(&self) -> String {
        let state = match &self.writer {
            None if self.sealed => "sealed".to_owned(),
            None => "aborted".to_owned(),
            Some(w) => format!("{} of {} bytes written", w.written(), self.size),
        };
        format!("<phalanx.ObjectWriter {} ({state})>", self.name)
    }
}
