//! Protection domain.

use super::sys::ibv_pd;
use super::{Context, VerbsError};
use std::sync::Arc;

pub struct ProtectionDomain {
    pub(crate) pd: *mut ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: a PD handle is used only as an argument of thread-safe verbs calls.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<ProtectionDomain>, VerbsError> {
        // SAFETY: the context is open (we hold an Arc to it).
        let pd = unsafe { (ctx.lib.alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(VerbsError::errno("ibv_alloc_pd"));
        }
        Ok(Arc::new(ProtectionDomain {
            pd,
            ctx: ctx.clone(),
        }))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc<ProtectionDomain>, so none of them is alive.
        unsafe { (self.ctx.lib.dealloc_pd)(self.pd) };
    }
}
