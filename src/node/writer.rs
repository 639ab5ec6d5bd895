//! Objects written in place ([`Node::create`]): the caller writes an object's bytes straight
//! into this node's store, where readers will read them, instead of handing a buffer to
//! [`Node::put`], which copies it in. A task that computes its output there saves that copy
//! (1 ms for 16 MiB on this machine, as long as 16 MiB takes on a 100 Gbit/s link). The
//! object is announced complete when it is sealed ([`ObjectWriter::seal`]); announced partial
//! before that ([`ObjectWriter::announce`]), it streams to its readers as it is written, as a
//! put's does. A writer dropped unsealed takes its copy, and any announcement, back.

use super::Node;
use crate::config::INLINE_LIMIT;
use crate::store::CopyRef;
use crate::{Error, ObjectId, Result};

/// An object being written in place; see the module.
pub struct ObjectWriter {
    node: Node,
    id: ObjectId,
    size: u64,
    body: Body,
    /// Announced to the directory as a partial copy.
    announced: bool,
    /// Sealed (or given up by `seal`): nothing to take back.
    done: bool,
}

/// Where the bytes go.
enum Body {
    /// The object's copy in the store (objects of `INLINE_LIMIT` bytes and more).
    Store(CopyRef),
    /// A small object's bytes (all `size` of them, zeroed at the start) and how many are
    /// written, which travel to the directory with its announcement at the seal, as a small
    /// put's do.
    Small { bytes: Vec<u8>, filled: usize },
}

impl Node {
    /// Starts an object of `size` bytes written in place in this node's store (see the
    /// module). Nothing is announced until [`ObjectWriter::announce`] or
    /// [`ObjectWriter::seal`]; `AlreadyExists` if this node holds `id` already,
    /// `OutOfMemory` if the store has no room.
    pub fn create(&self, id: impl Into<ObjectId>, size: u64) -> Result<ObjectWriter> {
        let id = id.into();
        let body = match size < INLINE_LIMIT {
            // Its copy is made at the seal (as a small put's): one here already is refused
            // now all the same, as for a large object.
            true if self.inner.store.lookup(&id).is_some() => {
                return Err(Error::AlreadyExists(id));
            }
            true => Body::Small {
                bytes: vec![0; size as usize],
                filled: 0,
            },
            false => {
                let (copy, evicted) = self.inner.store.create(&id, size, true)?;
                self.inner.dir.withdraw(&evicted);
                Body::Store(copy)
            }
        };
        Ok(ObjectWriter {
            node: self.clone(),
            id,
            size,
            body,
            announced: false,
            done: false,
        })
    }
}

impl Node {
    /// The bytes a copy-in takes at a time (`put_step`, at least 4 KiB): each piece is passed
    /// on to readers streaming the object as soon as it is in.
    pub(super) fn put_step(&self) -> u64 {
        self.inner.cfg.put_step.max(4096)
    }
}

impl ObjectWriter {
    pub fn id(&self) -> &ObjectId {
        &self.id
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes written so far (from the start, in order).
    pub fn written(&self) -> u64 {
        match &self.body {
            Body::Store(c) => c.watermark(),
            Body::Small { filled, .. } => *filled as u64,
        }
    }

    /// Announces the object as a partial copy here: its readers start now and are sent its
    /// bytes as they are written. A small object is announced whole at the seal instead
    /// (its bytes travel with the announcement): nothing to do.
    pub fn announce(&mut self) -> Result<()> {
        if let (Body::Store(_), false) = (&self.body, self.announced) {
            self.node.inner.dir.publish(&self.id, self.size, false)?;
            self.announced = true;
        }
        Ok(())
    }

    /// Appends `data` (copied in, in the node's `put_step` pieces, each passed on at once
    /// to readers streaming the object): [`Node::put`]'s copy-in.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        self.check_room(data.len() as u64)?;
        match &mut self.body {
            Body::Store(c) => {
                let step = self.node.put_step() as usize;
                for piece in data.chunks(step) {
                    c.append(piece)?;
                    self.node.inner.transfers.landed(c);
                }
            }
            Body::Small { bytes, filled } => {
                bytes[*filled..*filled + data.len()].copy_from_slice(data);
                *filled += data.len();
            }
        }
        Ok(())
    }

    /// Appends `len` bytes that `f` writes in place (no copy): `f` gets exactly those
    /// bytes of the object (their previous contents unspecified), and they are the
    /// object's once it returns.
    pub fn fill_with(&mut self, len: u64, f: impl FnOnce(&mut [u8])) -> Result<()> {
        self.check_room(len)?;
        match &mut self.body {
            Body::Store(c) => {
                c.fill_with(len, f)?;
                self.node.inner.transfers.landed(c);
            }
            Body::Small { bytes, filled } => {
                let at = *filled;
                f(&mut bytes[at..at + len as usize]);
                *filled += len as usize;
            }
        }
        Ok(())
    }

    /// The object's bytes not written yet, `[written, size)`: where they start and how
    /// many, for a caller that writes them in place through that address after this call
    /// (the Python binding exports them as a writable buffer), then says how many it wrote
    /// with [`ObjectWriter::commit`]. Nothing else writes them and nobody reads them before
    /// the commit; the address stays valid while the writer lives (also if the object is
    /// deleted meanwhile), and until a [`ObjectWriter::write`], `fill_with` or `commit`,
    /// which may take those bytes.
    pub fn unwritten(&mut self) -> Result<(std::ptr::NonNull<u8>, u64)> {
        match &mut self.body {
            Body::Store(c) => c.unfilled(),
            Body::Small { bytes, filled } => {
                let rest = &mut bytes[*filled..];
                let at = std::ptr::NonNull::new(rest.as_mut_ptr())
                    .unwrap_or(std::ptr::NonNull::dangling());
                Ok((at, rest.len() as u64))
            }
        }
    }

    /// `len` more bytes written, in place, through [`ObjectWriter::unwritten`]'s address:
    /// passed on to the object's readers streaming it, as `write`'s are.
    /// `InvalidArgument` if they do not fit, or (a copy in the store) were not taken with
    /// `unwritten`; a small object's bytes are zeros until written.
    pub fn commit(&mut self, len: u64) -> Result<()> {
        self.check_room(len)?;
        match &mut self.body {
            Body::Store(c) => {
                c.commit(len)?;
                self.node.inner.transfers.landed(c);
            }
            Body::Small { filled, .. } => *filled += len as usize,
        }
        Ok(())
    }

    /// Announces the object complete. Every byte must be written (`InvalidArgument`
    /// otherwise, and the object is taken back); `NotFound` if it was deleted meanwhile.
    pub fn seal(mut self) -> Result<()> {
        let written = self.written();
        if written != self.size {
            return Err(Error::InvalidArgument(format!(
                "{} sealed with {written} of its {} bytes written",
                self.id, self.size
            )));
        }
        self.done = true;
        let (node, id) = (&self.node, &self.id);
        match &self.body {
            Body::Small { bytes: v, .. } => {
                node.put_small(id, v, || node.inner.dir.put_inline(id, v))
            }
            // Deleted while it was written: announced complete now, the entry would come
            // back with a copy that is gone.
            Body::Store(c) if c.is_detached() => Err(Error::NotFound(id.clone())),
            Body::Store(_) => node.inner.dir.publish(id, self.size, true),
        }
    }

    /// `InvalidArgument` if `len` more bytes do not fit.
    fn check_room(&self, len: u64) -> Result<()> {
        match self.written().checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "{} bytes more at {} of {}, which has {}",
                len,
                self.written(),
                self.id,
                self.size
            ))),
        }
    }
}

impl Drop for ObjectWriter {
    /// Unsealed (or sealed short): the copy is dropped, and its announcement withdrawn.
    fn drop(&mut self) {
        if self.done && self.written() == self.size {
            return;
        }
        if let Body::Store(c) = &self.body {
            c.fail();
            if self.announced {
                self.node.inner.dir.withdraw(std::slice::from_ref(&self.id));
            }
        }
    }
}
