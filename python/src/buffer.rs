//! Bytes across the boundary: `ObjectBuffer` exports an object's bytes to Python without a
//! copy (the buffer protocol; `get` wraps it in a `memoryview`), and `Borrowed` reads or
//! fills any Python object that exports a contiguous buffer (bytes, bytearray, memoryview,
//! NumPy arrays).

use phalanx::ObjectView;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_int, c_void};

/// Read-only bytes of an object, exported through the buffer protocol. A view of an arena
/// copy holds a reference on that copy: its memory stays allocated (also after `delete`,
/// which only unlists it) until the last Python view of it is released.
#[pyclass(module = "phalanx", frozen)]
pub struct ObjectBuffer {
    name: String,
    bytes: ObjectView,
    /// Where the bytes are, taken once: a complete copy is immutable.
    ptr: usize,
    len: usize,
}

impl ObjectBuffer {
    /// Wraps a view; a view whose copy is no longer complete is refused (`NotFound`).
    pub fn new(name: String, bytes: ObjectView) -> PyResult<ObjectBuffer> {
        let (ptr, len) = match &bytes {
            ObjectView::Arena(c) => match c.as_slice() {
                Some(s) => (s.as_ptr() as usize, s.len()),
                None => {
                    return Err(crate::errors::NotFound::new_err(format!(
                        "object {name}: its copy was dropped before it could be read"
                    )))
                }
            },
            ObjectView::Owned(v) => (v.as_ptr() as usize, v.len()),
        };
        Ok(ObjectBuffer {
            name,
            bytes,
            ptr,
            len,
        })
    }

    /// The bytes (only while `self` lives).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr`/`len` were taken from `bytes`, which `self` owns: an owned vector is
        // never changed, and an arena copy is complete (immutable) and kept allocated by the
        // reference `bytes` holds, whatever a peer or a `delete` does meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

#[pymethods]
impl ObjectBuffer {
    /// Exports the bytes read-only (format "B"); a writable request raises `BufferError`.
    ///
    /// # Safety
    /// Called by the interpreter with a valid `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        // A zero-length buffer still needs a valid, non-null address.
        let ptr = if me.len == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr()
        } else {
            me.ptr as *mut u8
        };
        // SAFETY: `view` comes from the interpreter; FillInfo takes a new reference on `slf`,
        // which keeps `bytes` (and so the memory at `ptr`) alive until the view is released;
        // readonly = 1, so no consumer is handed write access.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut c_void,
                me.len as ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        let place = match self.bytes {
            ObjectView::Arena(_) => "arena",
            ObjectView::Owned(_) => "owned",
        };
        format!(
            "<phalanx.ObjectBuffer {} ({} bytes, {place})>",
            self.name, self.len
        )
    }

    /// The object's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Address of the first byte (for checking that a view shares the arena).
    #[getter]
    fn address(&self) -> usize {
        self.ptr
    }

    /// Whether the bytes are the node's arena copy (zero-copy) rather than a private copy
    /// (small objects that arrived inline in a directory message).
    #[getter]
    fn in_arena(&self) -> bool {
        matches!(self.bytes, ObjectView::Arena(_))
    }
}

/// A contiguous buffer borrowed from a Python object for the length of one call. Dropped with
/// the GIL held (the release calls into the exporter).
pub struct Borrowed {
    view: Box<ffi::Py_buffer>,
}

impl Borrowed {
    /// Borrows `obj`'s bytes, writable ones when `writable`; the exporter must provide them
    /// as one contiguous block (a strided NumPy view is refused with `BufferError`).
    pub fn new(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Borrowed> {
        let mut view = Box::new(ffi::Py_buffer::new());
        let flags = if writable {
            ffi::PyBUF_SIMPLE | ffi::PyBUF_WRITABLE
        } else {
            ffi::PyBUF_SIMPLE
        };
        // SAFETY: `view` is a valid, boxed (never moved) Py_buffer; on success the exporter
        // filled it and we release it exactly once, in Drop.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc == -1 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Borrowed { view })
    }

    pub fn len(&self) -> usize {
        self.view.len as usize
    }

    /// The bytes, read-only.
    pub fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: a PyBUF_SIMPLE export is `len` contiguous bytes at `buf`, valid until the
        // buffer is released (in Drop; the borrow of `self` ends before). The exporter cannot
        // resize or free it while exported; another Python thread could still write it, as
        // with any C extension reading a mutable buffer without the GIL.
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, self.len()) }
    }

    /// The bytes, writable; only for a buffer borrowed with `writable`.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len() == 0 {
            return &mut [];
        }
        assert!(self.view.readonly == 0, "borrowed writable");
        // SAFETY: as in `bytes`; the export was requested writable and the exclusive borrow of
        // `self` keeps this the only Rust slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.view.buf as *mut u8, self.len()) }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released once;
        // `attach` holds the GIL for the exporter's release function.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.view) });
    }
}
