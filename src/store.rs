//! The node's object store: copies carved out of the registered arena, each with a filled
//! watermark. Bytes below the watermark are final and may be read (and forwarded) while the
//! rest is still being written; that is what lets a copy in progress serve others.
//!
//! Memory safety rests on two rules. Only the copy's filler (a `put` or one inbound transfer)
//! writes, and only above the watermark; readers read only below it. A copy's range is freed
//! only when it is deleted, failed or evicted *and* no [`CopyRef`] holds it: senders,
//! readers, views and inbound transfers (whose writer may still be in flight) all hold one.
//!
//! A copy may also be made *within* another, in a part of its range above its watermark
//! ([`Store::create_within`]: a pull into its place in a larger object, with no copy
//! afterwards). That part is then the inner copy's filler's to write: the outer copy's filler
//! cannot write there, nor move the outer watermark over it, while the inner copy exists
//! unfinished, and the inner copy holds the outer one's memory (as a use) while it lives.

use crate::alloc::RangeAllocator;
use crate::{Error, ObjectId, Result};
use phalanx_transport::Arena;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyStatus {
    /// Memory allocated; `watermark` bytes are valid.
    Filling,
    Complete,
    /// The filler gave up; readers see an error.
    Failed,
}

#[derive(Debug)]
struct CopyState {
    id: ObjectId,
    offset: u64,
    size: u64,
    watermark: u64,
    status: CopyStatus,
    pinned: bool,
    users: u32,
    /// Detached from the name index (deleted, failed or evicted); freed when unused.
    detached: bool,
    /// Failed because every copy it could fill from died (`CopyRef::fail_lost`): its readers
    /// are told the object is lost, not that it is gone.
    lost: bool,
    last_use: u64,
    /// Readers waiting for this copy's bytes (`CopyRef::wait_beyond`) wait here, woken by its
    /// own progress only: a chunk landing in one copy does not wake every waiter of the node.
    progress: Arc<Condvar>,
    /// Waiters for the copy's end (complete, failed, deleted) or a kick wait here
    /// (`CopyRef::wait_complete`, `CopyRef::wait_kick`): not woken by every piece.
    ended: Arc<Condvar>,
    /// Kicks so far (`CopyRef::kick`), its end counted as one.
    kicks: u64,
    /// The copy whose range holds this one's bytes ([`Store::create_within`]): this one
    /// allocated nothing, and counts as a user of that one while it lives.
    within: Option<u64>,
    /// Copies within this one that still exist.
    inner: u32,
    /// The end of the bytes the filler has taken to write through [`CopyRef::append`] or
    /// [`CopyRef::fill_with`] (from the watermark): no copy is made within it there.
    claimed: u64,
}

impl CopyState {
    /// A new copy of `size` bytes at arena offset `offset`, nothing filled, unused.
    fn new(id: ObjectId, offset: u64, size: u64, pinned: bool) -> CopyState {
        CopyState {
            id,
            offset,
            size,
            watermark: 0,
            status: if size == 0 {
                CopyStatus::Complete
            } else {
                CopyStatus::Filling
            },
            pinned,
            users: 0,
            detached: false,
            lost: false,
            last_use: 0,
            progress: Arc::new(Condvar::new()),
            ended: Arc::new(Condvar::new()),
            kicks: 0,
            within: None,
            inner: 0,
            claimed: 0,
        }
    }

    /// Counts a kick (the copy's end counts as one) and wakes the waiters of both.
    fn kick(&mut self) {
        self.kicks += 1;
        self.ended.notify_all();
    }

    /// Why a reader of this copy, failed or dropped before it was complete, gets no bytes.
    fn gone(&self) -> Error {
        match self.lost {
            true => Error::ObjectLost(self.id.clone()),
            false => Error::NotFound(self.id.clone()),
        }
    }

    /// Complete, unpinned and still named: evicted to make room once no one uses it.
    fn evictable_when_released(&self) -> bool {
        self.status == CopyStatus::Complete && !self.pinned && !self.detached
    }
}

/// How long an allocation waits for an evictable copy that is still in use to be released.
const EVICTION_GRACE: Duration = Duration::from_millis(250);

#[derive(Debug)]
struct State {
    alloc: RangeAllocator,
    by_id: HashMap<ObjectId, u64>,
    copies: HashMap<u64, CopyState>,
    next_key: u64,
    tick: u64,
    /// Names whose copy was dropped here (deleted, evicted, failed) and not made again: a
    /// source asked for one refuses at once instead of waiting for a copy that is not coming
    /// ([`Store::recently_dropped`]).
    dropped: Dropped,
}

/// Names of dropped copies remembered, the oldest forgotten first.
const DROPPED_KEEP: usize = 1024;

/// The last [`DROPPED_KEEP`] names dropped: a set, and the order they came in (an entry of the
/// order whose number no longer matches the set's is stale).
#[derive(Debug, Default)]
struct Dropped {
    set: HashMap<ObjectId, u64>,
    order: VecDeque<(ObjectId, u64)>,
    next: u64,
}

impl Dropped {
    fn forget(&mut self, id: &ObjectId) {
        self.set.remove(id);
    }

    fn note(&mut self, id: ObjectId) {
        self.next += 1;
        self.set.insert(id.clone(), self.next);
        self.order.push_back((id, self.next));
        while self.order.len() > DROPPED_KEEP {
            let (old, n) = self.order.pop_front().expect("not empty");
            if self.set.get(&old) == Some(&n) {
                self.set.remove(&old);
            }
        }
    }
}

/// A summary of one copy, for tests and introspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyInfo {
    pub size: u64,
    pub watermark: u64,
    pub status: CopyStatus,
    pub pinned: bool,
}

pub struct Store {
    arena: Arc<Arena>,
    state: Mutex<State>,
    /// Copies created, deleted or released (what `wait_lookup` and a waiting allocation look
    /// for); a copy's progress has its own condition variable.
    changed: Condvar,
}

/// A counted reference to one copy; while it lives the copy's memory is not reused.
pub struct CopyRef {
    store: Arc<Store>,
    key: u64,
}

impl Store {
    pub fn new(arena: Arc<Arena>) -> Arc<Store> {
        let cap = arena.len() as u64;
        Arc::new(Store {
            arena,
            state: Mutex::new(State {
                alloc: RangeAllocator::new(cap),
                by_id: HashMap::new(),
                copies: HashMap::new(),
                next_key: 1,
                tick: 0,
                dropped: Dropped::default(),
            }),
            changed: Condvar::new(),
        })
    }

    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    fn new_ref(self: &Arc<Self>, st: &mut State, key: u64) -> CopyRef {
        st.tick += 1;
        let tick = st.tick;
        let c = st.copies.get_mut(&key).expect("live copy");
        c.users += 1;
        c.last_use = tick;
        CopyRef {
            store: self.clone(),
            key,
        }
    }

    /// Allocates `size` bytes, evicting least-recently-used unpinned idle complete copies as
    /// needed. Returns the offset and the ids evicted (to withdraw from the directory).
    fn allocate(st: &mut State, size: u64, evicted: &mut Vec<ObjectId>) -> Result<u64> {
        if size > st.alloc.capacity() {
            return Err(Error::OutOfMemory {
                requested: size,
                free: st.alloc.free_bytes(),
                capacity: st.alloc.capacity(),
            });
        }
        loop {
            if let Some(off) = st.alloc.alloc(size) {
                return Ok(off);
            }
            let victim = st
                .copies
                .iter()
                .filter(|(_, c)| c.users == 0 && Self::evictable(st, c))
                .min_by_key(|(_, c)| c.last_use)
                .map(|(k, _)| *k);
            let Some(k) = victim else {
                return Err(Error::OutOfMemory {
                    requested: size,
                    free: st.alloc.free_bytes(),
                    capacity: st.alloc.capacity(),
                });
            };
            let id = st.copies[&k].id.clone();
            st.by_id.remove(&id);
            st.dropped.note(id.clone());
            evicted.push(id);
            // A copy within another frees nothing itself: its outer copy's memory goes once
            // that one is unused too.
            Self::remove_unused(st, k);
        }
    }

    /// Creates a copy of `size` bytes for a local `put` (pinned until delete) or an inbound
    /// transfer. Fails with `AlreadyExists` when the node has a copy already.
    pub fn create(
        self: &Arc<Self>,
        id: &ObjectId,
        size: u64,
        pinned: bool,
    ) -> Result<(CopyRef, Vec<ObjectId>)> {
        self.create_with(id, size, pinned, false, EVICTION_GRACE)
    }

    /// Creates the pinned copy of an object this node produces (a reduce task's output). A
    /// pull of the same object still filling here (a reader that asked before this node was
    /// chosen to compute it, e.g. after a repair moved the tree's root) fails and gives way:
    /// its readers fetch again and find this copy. A pulled copy complete here (of the
    /// output's previous generation, which the repair reset: a reader's copy the reset did not
    /// reach, its pull told of no location) gives way too; views of it keep its bytes.
    pub fn create_output(
        self: &Arc<Self>,
        id: &ObjectId,
        size: u64,
    ) -> Result<(CopyRef, Vec<ObjectId>)> {
        self.create_with(id, size, true, true, EVICTION_GRACE)
    }

    /// [`Store::create_output`] that never waits: where room would have to be waited for (a
    /// copy still held a moment), it fails at once (for a thread that must not block).
    pub fn create_output_now(
        self: &Arc<Self>,
        id: &ObjectId,
        size: u64,
    ) -> Result<(CopyRef, Vec<ObjectId>)> {
        self.create_with(id, size, true, true, Duration::ZERO)
    }

    /// Frees the name `id` from a pulled copy (unpinned): an unfinished one fails, a complete
    /// one is dropped (its views keep it until released).
    fn give_way(st: &mut State, id: &ObjectId) {
        let Some(&k) = st.by_id.get(id) else {
            return;
        };
        let c = &st.copies[&k];
        if c.pinned {
            return;
        }
        match c.status {
            CopyStatus::Complete => Self::drop_name_locked(st, k),
            _ => Self::fail_locked(st, k),
        }
    }

    /// Fails copy `key` under the store's lock: its readers are woken to an error, its name
    /// is free again (if it still held it), and it is dropped once unused. A complete copy
    /// stays complete (its views hold its bytes: a task cancelled after its output was made,
    /// a pull abandoned as it completed); only its name goes.
    fn fail_locked(st: &mut State, key: u64) {
        let c = st.copies.get_mut(&key).expect("live copy");
        if c.status != CopyStatus::Complete {
            c.status = CopyStatus::Failed;
        }
        Self::drop_name_locked(st, key);
    }

    fn create_with(
        self: &Arc<Self>,
        id: &ObjectId,
        size: u64,
        pinned: bool,
        replace_pull: bool,
        grace: Duration,
    ) -> Result<(CopyRef, Vec<ObjectId>)> {
        let mut st = self.lock();
        if replace_pull {
            Self::give_way(&mut st, id);
        }
        if st.by_id.contains_key(id) {
            return Err(Error::AlreadyExists(id.clone()));
        }
        // A complete unpinned copy still held for a moment (the pull that just filled it, a
        // reader finishing) becomes evictable when released: wait briefly for it rather than
        // fail.
        let mut evicted = Vec::new();
        let deadline = Instant::now() + grace;
        let offset = loop {
            match Self::allocate(&mut st, size, &mut evicted) {
                Ok(off) => break off,
                Err(e) => {
                    let now = Instant::now();
                    let busy = st.copies.values().any(|c| Self::evictable(&st, c));
                    if !busy || now >= deadline || size > st.alloc.capacity() {
                        return Err(e);
                    }
                    st = self.changed.wait_timeout(st, deadline - now).unwrap().0;
                    if replace_pull {
                        Self::give_way(&mut st, id);
                    }
                    if st.by_id.contains_key(id) {
                        return Err(Error::AlreadyExists(id.clone()));
                    }
                }
            }
        };
        let r = self.add(&mut st, CopyState::new(id.clone(), offset, size, pinned));
        Ok((r, evicted))
    }

    /// Adds copy `c` under its name and returns the first reference to it.
    fn add(self: &Arc<Self>, st: &mut State, c: CopyState) -> CopyRef {
        let key = st.next_key;
        st.next_key += 1;
        st.by_id.insert(c.id.clone(), key);
        st.dropped.forget(&c.id);
        st.copies.insert(key, c);
        let r = self.new_ref(st, key);
        self.changed.notify_all();
        r
    }

    /// A reference to the local copy of `id`, if any (partial copies included).
    pub fn lookup(self: &Arc<Self>, id: &ObjectId) -> Option<CopyRef> {
        let mut st = self.lock();
        let k = *st.by_id.get(id)?;
        Some(self.new_ref(&mut st, k))
    }

    /// Like [`Store::lookup`], waiting up to `timeout` for the copy to be created.
    pub fn wait_lookup(self: &Arc<Self>, id: &ObjectId, timeout: Duration) -> Result<CopyRef> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if let Some(&k) = st.by_id.get(id) {
                return Ok(self.new_ref(&mut st, k));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::NotFound(id.clone()));
            }
            st = self.changed.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    pub fn info(&self, id: &ObjectId) -> Option<CopyInfo> {
        let st = self.lock();
        let c = &st.copies[st.by_id.get(id)?];
        Some(CopyInfo {
            size: c.size,
            watermark: c.watermark,
            status: c.status,
            pinned: c.pinned,
        })
    }

    /// Every copy held: id, size, complete, pinned (a producer's copy: a put or an output).
    pub fn summary(&self) -> Vec<(ObjectId, u64, bool, bool)> {
        let st = self.lock();
        st.by_id
            .iter()
            .map(|(id, k)| {
                let c = &st.copies[k];
                (
                    id.clone(),
                    c.size,
                    c.status == CopyStatus::Complete,
                    c.pinned,
                )
            })
            .collect()
    }

    /// Ids of every copy held (complete or not).
    pub fn ids(&self) -> Vec<ObjectId> {
        self.lock().by_id.keys().cloned().collect()
    }

    /// Removes `id` from this node; memory returns once the last reference is gone.
    /// Returns whether a copy existed.
    pub fn delete(&self, id: &ObjectId) -> bool {
        let mut st = self.lock();
        let Some(&k) = st.by_id.get(id) else {
            return false;
        };
        Self::drop_name_locked(&mut st, k);
        self.changed.notify_all();
        true
    }

    /// Drops copy `key`'s name under the store's lock: its waiters are woken (to what it
    /// holds), and it goes once unused.
    fn drop_name_locked(st: &mut State, key: u64) {
        let c = st.copies.get_mut(&key).expect("live copy");
        c.progress.notify_all();
        c.kick();
        let id = c.id.clone();
        if st.by_id.get(&id) == Some(&key) {
            st.by_id.remove(&id);
            st.dropped.note(id);
        }
        Self::detach(st, key);
    }

    fn detach(st: &mut State, k: u64) {
        let c = st.copies.get_mut(&k).expect("live copy");
        c.detached = true;
        if c.users == 0 {
            Self::remove_unused(st, k);
        }
    }

    /// Removes copy `k`, which no one uses, and returns its memory: its range to the
    /// allocator, or, for a copy within another, its use of that one (removed in turn if it
    /// was the last use of a detached copy).
    fn remove_unused(st: &mut State, k: u64) {
        let c = st.copies.remove(&k).expect("live copy");
        debug_assert!(c.users == 0 && c.inner == 0);
        match c.within {
            None => st.alloc.free(c.offset, c.size),
            Some(o) => {
                let outer = st.copies.get_mut(&o).expect("held by the copy within it");
                outer.users -= 1;
                outer.inner -= 1;
                if outer.users == 0 && outer.detached {
                    Self::remove_unused(st, o);
                }
            }
        }
    }

    /// Makes an unpinned copy of `id`, `len` bytes, in the range of `outer` that starts `at`
    /// bytes in, for an inbound transfer: it allocates nothing, and holds `outer`'s memory
    /// while it lives. `outer` is a pinned copy its own node fills (through
    /// [`CopyRef::append`] and [`CopyRef::fill_with`], never a pull); the range must be above
    /// what its filler has written or taken to write, and no other copy's. `outer`'s filler
    /// then leaves it to this copy's until this one is complete ([`CopyRef::advance_over`]).
    /// Fails with `AlreadyExists` when the node has a copy of `id` already.
    pub fn create_within(
        self: &Arc<Self>,
        outer: &CopyRef,
        id: &ObjectId,
        at: u64,
        len: u64,
    ) -> Result<CopyRef> {
        if !Arc::ptr_eq(self, &outer.store) {
            return Err(Error::InvalidArgument(
                "a copy within another store's".into(),
            ));
        }
        let mut st = self.lock();
        if st.by_id.contains_key(id) {
            return Err(Error::AlreadyExists(id.clone()));
        }
        let o = &st.copies[&outer.key];
        let fits = at.checked_add(len).is_some_and(|end| end <= o.size);
        if len == 0
            || !fits
            || at < o.watermark.max(o.claimed)
            || !o.pinned
            || o.status != CopyStatus::Filling
            || o.detached
            || o.within.is_some()
            || Self::inner_in(&st, outer.key, at, at + len)
                .next()
                .is_some()
        {
            return Err(Error::InvalidArgument(format!(
                "no room for {id} ({len} bytes at {at}) within {}",
                o.id
            )));
        }
        let offset = o.offset + at;
        let o = st.copies.get_mut(&outer.key).expect("live copy");
        o.users += 1;
        o.inner += 1;
        let mut c = CopyState::new(id.clone(), offset, len, false);
        c.within = Some(outer.key);
        Ok(self.add(&mut st, c))
    }

    /// The copies within copy `outer` whose ranges meet `[from, to)` of it (offsets in
    /// `outer`).
    fn inner_in(st: &State, outer: u64, from: u64, to: u64) -> impl Iterator<Item = &CopyState> {
        let o = &st.copies[&outer];
        let (lo, hi) = (o.offset + from, o.offset + to);
        // A copy with none within it (nearly all) looks at nothing: a filler's every piece
        // asks.
        let look = if o.inner > 0 { usize::MAX } else { 0 };
        st.copies
            .values()
            .take(look)
            .filter(move |c| c.within == Some(outer) && c.offset < hi && lo < c.offset + c.size)
    }

    /// Whether copy `c` may go to make room once no one uses it: complete, unpinned and
    /// named; a copy within another only if that one is detached (else its going frees
    /// nothing).
    fn evictable(st: &State, c: &CopyState) -> bool {
        c.evictable_when_released() && c.within.is_none_or(|o| st.copies[&o].detached)
    }

    /// Whether this node had a copy of `id` and dropped it (deleted, evicted or failed) and
    /// has none now: among the last [`DROPPED_KEEP`] names dropped.
    pub fn recently_dropped(&self, id: &ObjectId) -> bool {
        // A name made again is forgotten where it is made (`create_with`).
        self.lock().dropped.set.contains_key(id)
    }

    pub fn free_bytes(&self) -> u64 {
        self.lock().alloc.free_bytes()
    }

    pub fn capacity(&self) -> u64 {
        self.lock().alloc.capacity()
    }

    fn release(&self, key: u64) {
        let mut st = self.lock();
        let c = st.copies.get_mut(&key).expect("live copy");
        c.users -= 1;
        if c.users == 0 && c.detached {
            Self::remove_unused(&mut st, key);
        } else if c.users == 0 && c.evictable_when_released() {
            // An allocation may be waiting for it.
            self.changed.notify_all();
        }
    }
}

impl CopyRef {
    fn with<T>(&self, f: impl FnOnce(&CopyState) -> T) -> T {
        f(&self.store.lock().copies[&self.key])
    }

    pub fn id(&self) -> ObjectId {
        self.with(|c| c.id.clone())
    }

    pub fn size(&self) -> u64 {
        self.with(|c| c.size)
    }

    /// Arena offset of the copy's first byte.
    pub fn offset(&self) -> u64 {
        self.with(|c| c.offset)
    }

    pub fn watermark(&self) -> u64 {
        self.with(|c| c.watermark)
    }

    pub fn status(&self) -> CopyStatus {
        self.with(|c| c.status)
    }

    /// Whether this copy was removed from the store (deleted, failed or evicted).
    pub fn is_detached(&self) -> bool {
        self.with(|c| c.detached)
    }

    /// The arena offset and watermark of a filler's next `len` bytes, checked: inside the
    /// copy, and no copy within this one there (those bytes are its filler's).
    fn next_to_fill(&self, len: u64, what: &str) -> Result<(u64, u64)> {
        let mut st = self.store.lock();
        let c = &st.copies[&self.key];
        let (off, wm, size) = (c.offset, c.watermark, c.size);
        if wm.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::InvalidArgument(format!(
                "{what} of {len} bytes at {wm} overflows a copy of {size}"
            )));
        }
        if Store::inner_in(&st, self.key, wm, wm + len)
            .next()
            .is_some()
        {
            return Err(Error::InvalidArgument(format!(
                "{what} of {len} bytes at {wm} over a copy within {}",
                c.id
            )));
        }
        // Taken: no copy is made within these bytes while they are written.
        let c = st.copies.get_mut(&self.key).expect("live copy");
        c.claimed = c.claimed.max(wm + len);
        Ok((off, wm))
    }

    /// Appends bytes at the watermark (the filler's path for a local put).
    pub fn append(&self, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        let (off, wm) = self.next_to_fill(len, "append")?;
        // SAFETY: in bounds (checked above, copy lies in the arena); bytes above the watermark
        // with no copy within this one there are written only by this copy's single filler
        // and read by nobody.
        unsafe { self.store.arena.slice_mut(off + wm, len) }.copy_from_slice(data);
        self.advance_to(wm + len);
        Ok(())
    }

    /// Appends `len` bytes at the watermark, computed in place by `f` (the filler's path for a
    /// reduce output: no staging buffer).
    pub fn fill_with(&self, len: u64, f: impl FnOnce(&mut [u8])) -> Result<()> {
        let (off, wm) = self.next_to_fill(len, "fill")?;
        // SAFETY: in bounds (checked above); bytes above the watermark with no copy within
        // this one there are written only by this copy's single filler and read by nobody
        // until advance_to below.
        f(unsafe { self.store.arena.slice_mut(off + wm, len) });
        self.advance_to(wm + len);
        Ok(())
    }

    /// The copy's bytes from the watermark to its end, taken for its filler to write in
    /// place past this call (the Python binding exports them as a writable buffer), and
    /// then [`CopyRef::commit`]: where they start and how many. Nobody else writes them
    /// (no copy is made within them any more) and nobody reads them before the commit. The
    /// address stays valid while a reference to this copy lives.
    pub fn unfilled(&self) -> Result<(std::ptr::NonNull<u8>, u64)> {
        let rest = {
            let st = self.store.lock();
            let c = &st.copies[&self.key];
            c.size - c.watermark
        };
        let (off, wm) = self.next_to_fill(rest, "fill in place")?;
        // SAFETY: in bounds (checked by next_to_fill), and just taken for this copy's single
        // filler: nobody else writes or reads these bytes; only their address leaves here.
        let bytes = unsafe { self.store.arena.slice_mut(off + wm, rest) };
        let at = std::ptr::NonNull::new(bytes.as_mut_ptr()).expect("arena addresses are not null");
        Ok((at, rest))
    }

    /// Moves the watermark `len` bytes on, over bytes taken with [`CopyRef::unfilled`] and
    /// written in place: they are the copy's from now on, and readers streaming it are
    /// passed them.
    pub fn commit(&self, len: u64) -> Result<()> {
        let wm = {
            let st = self.store.lock();
            let c = &st.copies[&self.key];
            match c.watermark.checked_add(len) {
                Some(end) if end <= c.claimed.min(c.size) => end,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "commit of {len} bytes at {} of {}: not taken to fill in place",
                        c.watermark, c.id
                    )))
                }
            }
        };
        self.advance_to(wm);
        Ok(())
    }

    /// Moves the watermark over `inner`, a complete copy within this one that starts at the
    /// watermark: its bytes are this copy's there (the filler's path for a part pulled into
    /// its place, [`Store::create_within`]).
    pub fn advance_over(&self, inner: &CopyRef) -> Result<()> {
        let wm = {
            let st = self.store.lock();
            let o = &st.copies[&self.key];
            let i = Arc::ptr_eq(&self.store, &inner.store).then(|| &st.copies[&inner.key]);
            match i {
                Some(i)
                    if i.within == Some(self.key)
                        && i.offset == o.offset + o.watermark
                        && i.status == CopyStatus::Complete =>
                {
                    o.watermark + i.size
                }
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "not a complete copy within {} at its watermark",
                        o.id
                    )))
                }
            }
        };
        self.advance_to(wm);
        Ok(())
    }

    /// Whether a copy within this one still exists in `[from, to)` of it (its filler may
    /// still write there).
    pub fn holds_inner(&self, from: u64, to: u64) -> bool {
        let st = self.store.lock();
        let held = Store::inner_in(&st, self.key, from, to).next().is_some();
        held
    }

    /// Bytes `[at, at + len)`, which must be below the watermark. They are final, and this
    /// reference keeps them in place for the slice's lifetime.
    pub fn filled(&self, at: u64, len: u64) -> &[u8] {
        let (off, wm) = self.with(|c| (c.offset, c.watermark));
        assert!(at + len <= wm, "read above the watermark");
        // SAFETY: below the watermark bytes are never written again; &self keeps the range
        // allocated while the slice lives.
        unsafe { self.store.arena.slice(off + at, len) }
    }

    /// Blocks until at least `target` bytes are valid (or the copy is complete).
    pub fn wait_for(&self, target: u64, timeout: Duration) -> Result<u64> {
        let mut wm = self.watermark();
        while wm < target {
            let next = self.wait_beyond(wm, timeout)?;
            if next == wm {
                break; // complete and shorter than target
            }
            wm = next;
        }
        Ok(wm)
    }

    /// Moves the watermark to `wm` (bytes below it are final) and wakes readers.
    pub fn advance_to(&self, wm: u64) {
        let mut st = self.store.lock();
        let (from, size) = {
            let c = &st.copies[&self.key];
            (c.watermark, c.size)
        };
        debug_assert!(wm >= from && wm <= size);
        // Soundness: readers of this copy never see bytes a copy within it still writes.
        let over_unfinished = Store::inner_in(&st, self.key, from, wm.min(size))
            .any(|i| i.status != CopyStatus::Complete);
        if over_unfinished {
            drop(st); // a bug, not a peer's doing: panic without poisoning the store's lock
            panic!("watermark moved over an unfinished copy within");
        }
        let c = st.copies.get_mut(&self.key).expect("live copy");
        c.watermark = wm.min(c.size);
        if c.watermark == c.size && c.status == CopyStatus::Filling {
            c.status = CopyStatus::Complete;
            c.kick();
        }
        c.progress.notify_all();
    }

    /// Blocks until the copy is complete. Errors if it failed or was deleted, if its
    /// watermark did not move for `stall`, or at `until` if given. Unlike
    /// [`CopyRef::wait_beyond`] the waiter is woken once, at the end, not by every piece that
    /// lands.
    pub fn wait_complete(&self, stall: Duration, until: Option<Instant>) -> Result<()> {
        let mut st = self.store.lock();
        let mut last = st.copies[&self.key].watermark;
        let mut progressed = Instant::now();
        loop {
            let c = &st.copies[&self.key];
            match c.status {
                CopyStatus::Complete => return Ok(()),
                CopyStatus::Failed => return Err(c.gone()),
                _ if c.detached => return Err(c.gone()),
                CopyStatus::Filling => {}
            }
            let now = Instant::now();
            if c.watermark > last {
                (last, progressed) = (c.watermark, now);
            }
            let end = until.map_or(progressed + stall, |u| u.min(progressed + stall));
            if now >= end {
                return Err(Error::Timeout(stall, format!("bytes of {}", c.id)));
            }
            let ended = c.ended.clone();
            st = ended.wait_timeout(st, end - now).unwrap().0;
        }
    }

    /// How many times the copy was kicked so far, its end (complete, failed, deleted)
    /// counted as one (see [`CopyRef::wait_kick`]).
    pub fn kicks(&self) -> u64 {
        self.with(|c| c.kicks)
    }

    /// Wakes the waiters of [`CopyRef::wait_kick`]: the thread that moved the watermark asks
    /// the copy's other users to look (e.g. a forwarder that could not write its bytes asks
    /// the serve's worker to write them).
    pub fn kick(&self) {
        let mut st = self.store.lock();
        st.copies.get_mut(&self.key).expect("live copy").kick();
    }

    /// Blocks until a kick after the `seen`-th (or the copy's end) or `timeout`, whichever
    /// comes first.
    pub fn wait_kick(&self, seen: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut st = self.store.lock();
        loop {
            let c = &st.copies[&self.key];
            let now = Instant::now();
            if c.kicks != seen || now >= deadline {
                return;
            }
            let ended = c.ended.clone();
            st = ended.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    /// Marks the copy failed and detaches it; readers waiting on it get an error.
    pub fn fail(&self) {
        let mut st = self.store.lock();
        Store::fail_locked(&mut st, self.key);
        self.store.changed.notify_all();
    }

    /// Like [`CopyRef::fail`], because the object is lost (the directory said so): its
    /// readers get [`Error::ObjectLost`] instead of [`Error::NotFound`]. A complete copy stays
    /// complete.
    pub fn fail_lost(&self) {
        let mut st = self.store.lock();
        if let Some(c) = st.copies.get_mut(&self.key) {
            c.lost = c.status != CopyStatus::Complete;
        }
        Store::fail_locked(&mut st, self.key);
        self.store.changed.notify_all();
    }

    /// Whether `other` refers to this very copy (not merely one of the same object).
    pub fn is_same(&self, other: &CopyRef) -> bool {
        self.key == other.key && Arc::ptr_eq(&self.store, &other.store)
    }

    /// Blocks until the watermark passes `from` (or the copy is complete), then returns the
    /// watermark. Errors if the copy failed or was deleted, or after `timeout`.
    pub fn wait_beyond(&self, from: u64, timeout: Duration) -> Result<u64> {
        let deadline = Instant::now() + timeout;
        let mut st = self.store.lock();
        loop {
            let c = &st.copies[&self.key];
            match c.status {
                CopyStatus::Failed => return Err(c.gone()),
                _ if c.detached && c.status != CopyStatus::Complete => return Err(c.gone()),
                CopyStatus::Complete => return Ok(c.size),
                CopyStatus::Filling if c.watermark > from => return Ok(c.watermark),
                _ => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(timeout, format!("bytes of {}", c.id)));
            }
            let progress = c.progress.clone();
            st = progress.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    /// Copies `buf.len()` bytes at `at` out of the copy; they must be below the watermark.
    pub fn read_at(&self, at: u64, buf: &mut [u8]) {
        let (off, wm) = self.with(|c| (c.offset, c.watermark));
        assert!(at + buf.len() as u64 <= wm, "read above the watermark");
        // SAFETY: below the watermark bytes are final and never written again; our reference
        // keeps the range allocated.
        buf.copy_from_slice(unsafe { self.store.arena.slice(off + at, buf.len() as u64) });
    }

    /// The whole copy as a slice; only for a complete copy.
    pub fn as_slice(&self) -> Option<&[u8]> {
        let (off, size, status) = self.with(|c| (c.offset, c.size, c.status));
        if status != CopyStatus::Complete {
            return None;
        }
        // SAFETY: a complete copy is immutable and stays allocated while this reference lives
        // (the returned slice borrows it).
        Some(unsafe { self.store.arena.slice(off, size) })
    }
}

impl Clone for CopyRef {
    fn clone(&self) -> Self {
        let mut st = self.store.lock();
        self.store.new_ref(&mut st, self.key)
    }
}

impl Drop for CopyRef {
    fn drop(&mut self) {
        self.store.release(self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(cap: usize) -> Arc<Store> {
        Store::new(Arc::new(Arena::new(cap, false).unwrap()))
    }

    #[test]
    fn put_read_and_watermark() {
        let s = store(1 << 20);
        let id = ObjectId::new("a");
        let (r, _) = s.create(&id, 10, true).unwrap();
        r.append(&[1, 2, 3]).unwrap();
        assert_eq!(r.wait_beyond(0, Duration::from_millis(10)).unwrap(), 3);
        assert!(r.wait_beyond(3, Duration::from_millis(10)).is_err());
        r.append(&[4; 7]).unwrap();
        assert_eq!(r.status(), CopyStatus::Complete);
        assert_eq!(r.as_slice().unwrap(), &[1, 2, 3, 4, 4, 4, 4, 4, 4, 4]);
        assert!(matches!(
            s.create(&id, 1, true),
            Err(Error::AlreadyExists(_))
        ));
        assert!(r.append(&[0]).is_err());
    }

    /// A node chosen to produce an object it was pulling: the pull gives way (its readers
    /// see it fail and find the output), and so does a pulled copy complete here (of the
    /// output's previous generation; a view of it keeps its bytes); a put does not.
    #[test]
    fn an_output_replaces_a_pulled_copy_not_a_put() {
        let s = store(1 << 16);
        let (pull, _) = s.create(&"t".into(), 1024, false).unwrap();
        pull.append(&[7; 100]).unwrap();
        let (out, _) = s.create_output(&"t".into(), 1024).unwrap();
        assert!(pull.wait_beyond(0, Duration::from_millis(1)).is_err());
        assert!(s.lookup(&"t".into()).unwrap().is_same(&out));
        assert!(!pull.is_same(&out));
        assert!(matches!(
            s.create_output(&"t".into(), 1024),
            Err(Error::AlreadyExists(_))
        ));
        let (done, _) = s.create(&"c".into(), 4, false).unwrap();
        done.append(&[1; 4]).unwrap();
        let (again, _) = s.create_output(&"c".into(), 4).unwrap();
        assert!(s.lookup(&"c".into()).unwrap().is_same(&again));
        assert_eq!(
            done.as_slice().unwrap(),
            &[1; 4],
            "the old copy's view keeps its bytes"
        );
        let (put, _) = s.create(&"p".into(), 4, true).unwrap();
        put.append(&[2; 4]).unwrap();
        assert!(matches!(
            s.create_output(&"p".into(), 4),
            Err(Error::AlreadyExists(_))
        ));
    }

    #[test]
    fn lru_eviction_spares_pinned_and_used_copies() {
        let s = store(4096);
        let (a, _) = s.create(&"a".into(), 2048, false).unwrap();
        a.append(&[3; 2048]).unwrap();
        drop(a);
        let (pinned, _) = s.create(&"p".into(), 1024, true).unwrap();
        pinned.append(&[1; 1024]).unwrap();
        let (b, _) = s.create(&"b".into(), 1024, false).unwrap();
        b.append(&[2; 1024]).unwrap();
        // "b" is in use (a reader holds it), "p" is pinned: only "a" may go.
        let (c, evicted) = s.create(&"c".into(), 2048, false).unwrap();
        assert_eq!(evicted, vec![ObjectId::new("a")]);
        drop(c);
        assert!(s.lookup(&"a".into()).is_none());
        assert_eq!(b.as_slice().unwrap(), &[2; 1024][..]);
        // Nothing evictable is left for another 2 KiB ("c" is still filling): a clear error,
        // and nobody harmed.
        let e = s.create(&"d".into(), 2048, false).err().unwrap();
        assert!(
            matches!(
                e,
                Error::OutOfMemory {
                    requested: 2048,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(pinned.as_slice().unwrap(), &[1; 1024][..]);
        assert!(s.lookup(&"c".into()).is_some());
    }

    #[test]
    fn delete_defers_free_until_unused() {
        let s = store(2048);
        let (r, _) = s.create(&"x".into(), 2048, true).unwrap();
        r.append(&[9; 2048]).unwrap();
        assert!(s.delete(&"x".into()));
        assert!(s.lookup(&"x".into()).is_none());
        assert_eq!(s.free_bytes(), 0, "range still held by a reference");
        assert_eq!(r.as_slice().unwrap()[0], 9);
        drop(r);
        assert_eq!(s.free_bytes(), 2048);
    }

    #[test]
    fn dropped_names_are_remembered_until_made_again_and_bounded() {
        let s = store(4096);
        let x: ObjectId = "x".into();
        assert!(!s.recently_dropped(&x), "never here");
        let (r, _) = s.create(&x, 1024, false).unwrap();
        r.append(&[1; 1024]).unwrap();
        assert!(!s.recently_dropped(&x), "here");
        assert!(s.delete(&x));
        assert!(s.recently_dropped(&x), "deleted");
        let (again, _) = s.create(&x, 1024, false).unwrap();
        assert!(!s.recently_dropped(&x), "made again");
        again.fail();
        assert!(s.recently_dropped(&x), "failed");
        // Evicted to make room: remembered too.
        drop((r, again));
        let (e, _) = s.create(&"e".into(), 4096, false).unwrap();
        e.append(&[2; 4096]).unwrap();
        drop(e);
        let (f, evicted) = s.create(&"f".into(), 4096, false).unwrap();
        assert_eq!(evicted, vec![ObjectId::from("e")]);
        assert!(s.recently_dropped(&"e".into()));
        drop(f);
        s.delete(&"f".into());
        // Bounded: the oldest names are forgotten.
        for k in 0..DROPPED_KEEP {
            let id = ObjectId::new(format!("n{k}"));
            let (c, _) = s.create(&id, 1, false).unwrap();
            drop(c);
            s.delete(&id);
        }
        assert!(!s.recently_dropped(&x), "forgotten");
        assert!(s.recently_dropped(&ObjectId::new(format!("n{}", DROPPED_KEEP - 1))));
        assert!(s.lock().dropped.set.len() <= DROPPED_KEEP);
        assert!(s.lock().dropped.order.len() <= DROPPED_KEEP);
    }

    #[test]
    fn a_complete_copy_failed_keeps_its_bytes_for_its_views_and_frees_its_name() {
        let s = store(4096);
        let x: ObjectId = "x".into();
        let (c, _) = s.create(&x, 4, false).unwrap();
        c.append(&[1, 2, 3, 4]).unwrap();
        let view = crate::ObjectView::Arena(c.clone());
        c.fail();
        // Still whole for the view taken before (its deref must not fail), and for waiters.
        assert_eq!(&view[..], &[1, 2, 3, 4]);
        assert_eq!(c.status(), CopyStatus::Complete);
        assert!(c.wait_complete(Duration::from_millis(1), None).is_ok());
        // The name is free: not found, and made again with other bytes.
        assert!(s.lookup(&x).is_none());
        let (again, _) = s.create(&x, 4, false).unwrap();
        again.append(&[9; 4]).unwrap();
        assert_eq!(&view[..], &[1, 2, 3, 4]);
        assert_eq!(again.as_slice().unwrap(), &[9; 4]);
    }

    #[test]
    fn wait_lookup_sees_a_later_create() {
        let s = store(4096);
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            s2.wait_lookup(&"y".into(), Duration::from_secs(5))
                .map(|r| r.size())
        });
        std::thread::sleep(Duration::from_millis(20));
        let (a, _) = s.create(&"y".into(), 100, false).unwrap();
        assert_eq!(t.join().unwrap().unwrap(), 100);
        a.fail();
        assert!(a.wait_beyond(0, Duration::from_millis(1)).is_err());
        assert!(s.lookup(&"y".into()).is_none());
        assert!(s
            .wait_lookup(&"y".into(), Duration::from_millis(5))
            .is_err());
    }

    #[test]
    fn an_allocation_waits_briefly_for_an_evictable_copy_in_use() {
        let s = store(1 << 20);
        let (a, _) = s.create(&ObjectId::new("a"), 768 << 10, false).unwrap();
        a.append(&vec![7; 768 << 10]).unwrap();
        // Held for a moment (like the pull that just filled it), then released.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(a);
        });
        let (b, evicted) = s.create(&ObjectId::new("b"), 768 << 10, true).unwrap();
        assert_eq!(evicted, vec![ObjectId::new("a")]);
        assert!(s.lookup(&ObjectId::new("a")).is_none());
        t.join().unwrap();
        // Pinned copies are never waited for: no room, at once.
        let t0 = Instant::now();
        match s.create(&ObjectId::new("c"), 768 << 10, true) {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!("{:?}", other.map(|_| ())),
        }
        assert!(t0.elapsed() < EVICTION_GRACE);
        // Bigger than the arena: nothing is evicted for it.
        drop(b);
        assert!(matches!(
            s.create(&ObjectId::new("d"), 2 << 20, true),
            Err(Error::OutOfMemory { .. })
        ));
    }

    /// A reader of the whole copy wakes at its end, not at each piece; a stall, a failure
    /// and a deadline end the wait with their own errors.
    #[test]
    fn wait_complete_ends_at_the_end_a_stall_a_failure_or_the_deadline() {
        let s = store(1 << 20);
        let (c, _) = s.create(&ObjectId::new("w"), 300, false).unwrap();
        let filler = c.clone();
        let t = std::thread::spawn(move || {
            for _ in 0..3 {
                std::thread::sleep(Duration::from_millis(20));
                filler.append(&[5; 100]).unwrap();
            }
        });
        // Each piece comes well within the stall bound: complete.
        c.wait_complete(Duration::from_millis(500), None).unwrap();
        assert_eq!(c.watermark(), 300);
        t.join().unwrap();
        // No progress for the stall bound: a timeout, though no deadline was given.
        let (d, _) = s.create(&ObjectId::new("x"), 10, false).unwrap();
        d.append(&[1; 5]).unwrap();
        let t0 = Instant::now();
        let r = d.wait_complete(Duration::from_millis(60), None);
        assert!(matches!(r, Err(Error::Timeout(..))), "{r:?}");
        assert!(t0.elapsed() >= Duration::from_millis(60));
        // A deadline before the stall bound ends it first.
        let t0 = Instant::now();
        let r = d.wait_complete(Duration::from_secs(5), Some(t0 + Duration::from_millis(40)));
        assert!(matches!(r, Err(Error::Timeout(..))), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        // A failure wakes the waiter with an error at once.
        let failer = d.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            failer.fail();
        });
        let t0 = Instant::now();
        let r = d.wait_complete(Duration::from_secs(5), None);
        assert!(matches!(r, Err(Error::NotFound(_))), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        t.join().unwrap();
    }

    /// `wait_kick` returns on a kick or the copy's end, whichever comes, and not for the
    /// pieces that land meanwhile.
    #[test]
    fn wait_kick_wakes_on_a_kick_or_the_end_not_on_pieces() {
        let s = store(1 << 20);
        let (c, _) = s.create(&ObjectId::new("k"), 200, false).unwrap();
        let seen = c.kicks();
        c.append(&[1; 100]).unwrap();
        let t0 = Instant::now();
        c.wait_kick(seen, Duration::from_millis(50));
        assert!(
            t0.elapsed() >= Duration::from_millis(50),
            "a piece is not a kick"
        );
        let kicker = c.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            kicker.kick();
        });
        let t0 = Instant::now();
        c.wait_kick(seen, Duration::from_secs(5));
        assert!(t0.elapsed() < Duration::from_secs(2));
        t.join().unwrap();
        // A kick already counted returns at once; the end counts as one.
        let seen = c.kicks();
        c.append(&[2; 100]).unwrap();
        assert_eq!(c.kicks(), seen + 1, "completion is a kick");
        let t0 = Instant::now();
        c.wait_kick(seen, Duration::from_secs(5));
        assert!(t0.elapsed() < Duration::from_secs(1));
    }

    /// A part pulled into its place in a larger copy: its filler writes there, the outer
    /// copy's filler cannot (nor move its watermark over the part) until the part is
    /// complete, and then takes the bytes as they are.
    #[test]
    fn a_copy_within_another_fills_its_place_and_the_outer_copy_takes_it() {
        let s = store(1 << 20);
        let free = s.free_bytes();
        let (outer, _) = s.create(&"whole".into(), 100, true).unwrap();
        let held = s.free_bytes();
        let inner = s.create_within(&outer, &"part".into(), 40, 30).unwrap();
        assert_eq!(s.free_bytes(), held, "the part allocated nothing");
        assert_eq!(inner.offset(), outer.offset() + 40);
        assert!(s.lookup(&"part".into()).unwrap().is_same(&inner));
        outer.append(&[1; 40]).unwrap();
        assert!(
            outer.append(&[1; 1]).is_err(),
            "the part's bytes are its filler's"
        );
        assert!(outer.fill_with(10, |_| {}).is_err());
        inner.append(&[2; 10]).unwrap();
        assert!(outer.advance_over(&inner).is_err(), "not complete yet");
        assert!(outer.holds_inner(40, 70) && !outer.holds_inner(0, 40));
        inner.append(&[2; 20]).unwrap();
        assert_eq!(inner.status(), CopyStatus::Complete);
        outer.advance_over(&inner).unwrap();
        assert_eq!(outer.watermark(), 70);
        outer.append(&[3; 30]).unwrap();
        let mut want = vec![1; 40];
        want.extend([2; 30]);
        want.extend([3; 30]);
        assert_eq!(outer.as_slice().unwrap(), &want[..]);
        assert_eq!(inner.as_slice().unwrap(), &[2; 30]);
        // The outer copy deleted first: its memory stays while the part lives.
        assert!(s.delete(&"whole".into()));
        drop(outer);
        assert_eq!(s.free_bytes(), held);
        assert_eq!(inner.as_slice().unwrap(), &[2; 30], "still in place");
        assert!(s.delete(&"part".into()));
        assert_eq!(s.free_bytes(), held, "the view still holds it");
        drop(inner);
        assert_eq!(s.free_bytes(), free, "both gone");
        assert!(s.summary().is_empty());
    }

    /// Where a part cannot go: below the watermark, over another part, out of the copy, in a
    /// complete copy, under a name already here. A failed part blocks its place while a
    /// reference (its pull's writer) holds it; then the outer filler may write there.
    #[test]
    fn a_copy_within_another_is_refused_where_it_cannot_go() {
        let s = store(1 << 20);
        let (outer, _) = s.create(&"whole".into(), 100, true).unwrap();
        outer.append(&[0; 10]).unwrap();
        let bad = |at, len| {
            matches!(
                s.create_within(&outer, &"p".into(), at, len),
                Err(Error::InvalidArgument(_))
            )
        };
        assert!(bad(5, 10), "below the watermark");
        assert!(bad(90, 20), "past the end");
        assert!(bad(u64::MAX, 2), "overflowing");
        assert!(bad(20, 0), "empty");
        let a = s.create_within(&outer, &"a".into(), 20, 30).unwrap();
        assert!(bad(40, 20), "over another part");
        assert!(matches!(
            s.create_within(&outer, &"a".into(), 60, 10),
            Err(Error::AlreadyExists(_))
        ));
        assert!(
            matches!(
                s.create_within(&a, &"b".into(), 0, 5),
                Err(Error::InvalidArgument(_))
            ),
            "within a part"
        );
        // Not in bytes the filler is writing, nor in a copy a pull fills.
        outer
            .fill_with(5, |_| assert!(bad(10, 5), "taken by the filler"))
            .unwrap();
        let (pulled, _) = s.create(&"pulled".into(), 100, false).unwrap();
        assert!(matches!(
            s.create_within(&pulled, &"q".into(), 50, 10),
            Err(Error::InvalidArgument(_))
        ));
        let writer = a.clone();
        a.fail();
        outer.append(&[0; 5]).unwrap();
        assert!(
            outer.holds_inner(20, 50),
            "its writer may still write there"
        );
        assert!(outer.append(&[0; 1]).is_err());
        drop(a);
        assert!(outer.holds_inner(20, 50));
        drop(writer);
        assert!(!outer.holds_inner(20, 50));
        outer.append(&[0; 80]).unwrap();
        assert!(bad(95, 5), "complete");
    }
}
