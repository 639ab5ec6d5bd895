//! Completion channel and completion queue (event mode with `poll(2)` on the channel's fd).

use super::sys::{self, ibv_comp_channel, ibv_cq, ibv_wc, Lib};
use super::{Context, VerbsError};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

/// A completion channel: a file descriptor that becomes readable when an armed CQ gets a
/// completion. Its fd is non-blocking so waits are bounded by `poll(2)` timeouts.
pub struct CompletionChannel {
    ch: *mut ibv_comp_channel,
    lib: &'static Lib,
    _ctx: Arc<Context>,
}

// SAFETY: the channel is only used through thread-safe verbs and poll(2) on its fd.
unsafe impl Send for CompletionChannel {}
// SAFETY: as above.
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CompletionChannel>, VerbsError> {
        // SAFETY: the context is open.
        let ch = unsafe { (ctx.lib.create_comp_channel)(ctx.ctx) };
        if ch.is_null() {
            return Err(VerbsError::errno("ibv_create_comp_channel"));
        }
        let c = CompletionChannel {
            ch,
            lib: ctx.lib,
            _ctx: ctx.clone(),
        };
        // SAFETY: ch is valid; fd is a field of the channel struct.
        let fd = unsafe { (*ch).fd };
        // SAFETY: fcntl on an fd we own (through the channel) with standard flags.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
        };
        if rc < 0 {
            return Err(VerbsError::errno("fcntl(O_NONBLOCK)"));
        }
        Ok(Arc::new(c))
    }

    fn fd(&self) -> i32 {
        // SAFETY: the channel is alive while self is.
        unsafe { (*self.ch).fd }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds an Arc to it, so none is alive.
        unsafe { (self.lib.destroy_comp_channel)(self.ch) };
    }
}

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub qp_num: u32,
    pub byte_len: u32,
    /// Immediate data (host order) of a receive completion of a write-with-immediate.
    pub imm: Option<u32>,
}

impl WorkCompletion {
    pub fn is_ok(&self) -> bool {
        self.status == sys::IBV_WC_SUCCESS
    }

    pub fn is_recv(&self) -> bool {
        self.opcode & sys::IBV_WC_RECV != 0
    }

    /// The verbs name of the status, e.g. "transport retry counter exceeded".
    pub fn status_str(&self) -> String {
        let Ok(lib) = sys::lib() else {
            return format!("status {}", self.status);
        };
        // SAFETY: ibv_wc_status_str returns a static C string for any value.
        unsafe { std::ffi::CStr::from_ptr((lib.wc_status_str)(self.status)) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A completion queue attached to its own completion channel.
pub struct CompletionQueue {
    pub(crate) cq: *mut ibv_cq,
    channel: Arc<CompletionChannel>,
    capacity: usize,
}

// SAFETY: poll/arm/destroy are thread safe in libibverbs; we poll from one thread at a time
// anyway (the transport's progress thread).
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    pub fn new(ctx: &Arc<Context>, entries: usize) -> Result<Arc<CompletionQueue>, VerbsError> {
        let channel = CompletionChannel::new(ctx)?;
        let entries = entries.min(ctx.max_cqe().max(1) as usize) as i32;
        // SAFETY: the context and the channel are alive; cq_context is unused (null).
        let cq =
            unsafe { (ctx.lib.create_cq)(ctx.ctx, entries, std::ptr::null_mut(), channel.ch, 0) };
        if cq.is_null() {
            return Err(VerbsError::errno("ibv_create_cq"));
        }
        // SAFETY: cq is valid; cqe is the actual capacity the provider granted.
        let capacity = unsafe { (*cq).cqe }.max(0) as usize;
        let q = CompletionQueue {
            cq,
            channel,
            capacity,
        };
        q.arm()?;
        Ok(Arc::new(q))
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Requests an event on the channel for the next completion.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is alive.
        let rc = unsafe { sys::req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Appends up to `max` completions to `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        let mut total = 0;
        while total < max {
            // SAFETY: ibv_wc is plain old data; zero is a valid bit pattern.
            let mut wc: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
            let want = BATCH.min(max - total) as i32;
            // SAFETY: the CQ is alive and `wc` has room for `want` entries.
            let n = unsafe { sys::poll_cq(self.cq, want, wc.as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::code("ibv_poll_cq", n));
            }
            for w in &wc[..n as usize] {
                let imm = if w.wc_flags & sys::IBV_WC_WITH_IMM != 0 {
                    // SAFETY: IBV_WC_WITH_IMM says the union holds imm_data (big endian).
                    Some(u32::from_be(unsafe { w.imm.imm_data }))
                } else {
                    None
                };
                out.push(WorkCompletion {
                    wr_id: w.wr_id,
                    status: w.status,
                    opcode: w.opcode,
                    qp_num: w.qp_num,
                    byte_len: w.byte_len,
                    imm,
                });
            }
            total += n as usize;
            if (n as usize) < BATCH {
                break;
            }
        }
        Ok(total)
    }

    /// Waits up to `timeout` for a completion event or for `extra` (another fd, e.g. an
    /// eventfd used to wake the waiter) to become readable. A completion event is consumed,
    /// acknowledged and the CQ re-armed. Returns (completion event, extra readable). The
    /// caller polls the CQ after this whatever it returns (completions may have arrived
    /// before the CQ was armed).
    pub fn wait(
        &self,
        extra: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<(bool, bool), VerbsError> {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let fd = self.channel.fd();
        // SAFETY: the fd belongs to the channel, which outlives this call.
        let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
        let mut fds = vec![PollFd::new(bfd, PollFlags::POLLIN)];
        if let Some(e) = extra {
            fds.push(PollFd::new(e, PollFlags::POLLIN));
        }
        let ms = timeout.as_millis().min(u16::MAX as u128) as u16;
        match nix::poll::poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) => return Ok((false, false)),
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => return Ok((false, false)),
            Err(e) => {
                return Err(VerbsError::Call {
                    call: "poll(comp_channel)",
                    source: e.into(),
                })
            }
        }
        let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
        let extra_ready = fds.len() > 1 && ready(&fds[1]);
        if !ready(&fds[0]) {
            return Ok((false, extra_ready));
        }
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive; out-pointers are valid. The fd is non-blocking, so
        // this returns -1/EAGAIN if another reader took the event.
        let rc = unsafe { (self.channel.lib.get_cq_event)(self.channel.ch, &mut cq, &mut ctx) };
        if rc != 0 {
            return Ok((false, extra_ready));
        }
        // SAFETY: the only CQ on this channel is ours; acknowledging right away keeps the
        // unacked count at zero so ibv_destroy_cq never blocks.
        unsafe { (self.channel.lib.ack_cq_events)(cq, 1) };
        self.arm()?;
        Ok((true, extra_ready))
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an Arc to it, so none is alive; all events were
        // acknowledged in `wait`. The channel (an Arc field) is dropped after this.
        unsafe { (self.channel.lib.destroy_cq)(self.cq) };
    }
}
