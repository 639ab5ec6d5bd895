//! What a get hands back: a zero-copy view of a complete copy, or a reader that streams a
//! copy while it is still arriving.

use crate::store::CopyRef;
use std::time::Duration;

/// A read-only view of a complete object; the copy stays in place while the view lives.
pub enum ObjectView {
    Arena(CopyRef),
    Owned(Vec<u8>),
}

impl std::ops::Deref for ObjectView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ObjectView::Arena(c) => c.as_slice().expect("views hold complete copies"),
            ObjectView::Owned(v) => v,
        }
    }
}

/// Reads an object front to back while it is still arriving.
pub struct ObjectReader {
    pub(crate) src: Fetched,
    pub(crate) pos: u64,
    pub(crate) timeout: Duration,
}

pub(crate) enum Fetched {
    Copy(CopyRef),
    Owned(Vec<u8>),
}

impl ObjectReader {
    /// Total size of the object.
    pub fn size(&self) -> u64 {
        match &self.src {
            Fetched::Copy(c) => c.size(),
            Fetched::Owned(v) => v.len() as u64,
        }
    }
}

impl std::io::Read for ObjectReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &self.src {
            Fetched::Owned(v) => {
                let rest = &v[(self.pos as usize).min(v.len())..];
                let n = rest.len().min(buf.len());
                buf[..n].copy_from_slice(&rest[..n]);
                self.pos += n as u64;
                Ok(n)
            }
            Fetched::Copy(c) => {
                if buf.is_empty() || self.pos >= c.size() {
                    return Ok(0);
                }
                let wm = c
                    .wait_beyond(self.pos, self.timeout)
                    .map_err(std::io::Error::other)?;
                let n = ((wm - self.pos) as usize).min(buf.len());
                c.read_at(self.pos, &mut buf[..n]);
                self.pos += n as u64;
                Ok(n)
            }
        }
    }
}
