//! One tree position at work: `own ⊕ children` streamed into its output as the inputs fill.

use crate::node::Inner;
use crate::ops::{combine, combine_into};
use crate::protocol::ReduceTask;
use crate::view::Fetched;
use crate::{Error, ObjectId, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

enum Input {
    Copy(crate::store::CopyRef),
    Owned(Vec<u8>),
}

impl Input {
    fn size(&self) -> u64 {
        match self {
            Input::Copy(c) => c.size(),
            Input::Owned(v) => v.len() as u64,
        }
    }

    fn wait_for(&self, n: u64, timeout: Duration) -> Result<u64> {
        match self {
            Input::Copy(c) => c.wait_for(n, timeout),
            Input::Owned(v) => Ok(v.len() as u64),
        }
    }

    fn bytes(&self, from: u64, to: u64) -> &[u8] {
        match self {
            Input::Copy(c) => c.filled(from, to - from),
            Input::Owned(v) => &v[from as usize..to as usize],
        }
    }
}

impl Inner {
    fn input(self: &Arc<Self>, id: &ObjectId) -> Result<Input> {
        Ok(match self.fetch(id)? {
            Fetched::Copy(c) => Input::Copy(c),
            Fetched::Owned(v) => Input::Owned(v),
        })
    }

    /// Runs one tree position; called on the node that holds `task.own`.
    pub(crate) fn run_reduce_task(
        self: &Arc<Self>,
        t: &ReduceTask,
        cancel: &AtomicBool,
    ) -> Result<()> {
        let cancelled = || Error::InvalidArgument(format!("reduce task for {} cancelled", t.out));
        let own = self.input(&t.own)?;
        let children = t
            .children
            .iter()
            .map(|c| self.input(c))
            .collect::<Result<Vec<_>>>()?;
        for (id, i) in std::iter::once(&t.own)
            .zip(std::iter::once(&own))
            .chain(t.children.iter().zip(&children))
        {
            if i.size() != t.size {
                return Err(Error::InvalidArgument(format!(
                    "reduce input {id} has {} bytes, expected {}",
                    i.size(),
                    t.size
                )));
            }
        }
        if cancel.load(Ordering::Acquire) {
            return Err(cancelled());
        }
        let (out, evicted) = self.store.create(&t.out, t.size, true)?;
        self.withdraw(&evicted);
        let r = self.fill_reduce_output(t, &own, &children, &out, cancel);
        if r.is_err() {
            // Readers of the partial output (local ones and the pulls it serves) get an error
            // now instead of waiting for bytes that will not come.
            out.fail();
        }
        r
    }

    /// Streams `own ⊕ children` into `out` chunk by chunk as the inputs fill.
    fn fill_reduce_output(
        &self,
        t: &ReduceTask,
        own: &Input,
        children: &[Input],
        out: &crate::store::CopyRef,
        cancel: &AtomicBool,
    ) -> Result<()> {
        let esz = t.dtype.size() as u64;
        let cancelled = || Error::InvalidArgument(format!("reduce task for {} cancelled", t.out));
        self.publish(&t.out, t.size, false)?;
        let chunk = (t.chunk / esz).max(1) * esz;
        let timeout = self.cfg.op_timeout;
        let mut off = 0;
        while off < t.size {
            let need = (off + esz).min(t.size);
            let mut avail = t.size;
            for i in std::iter::once(own).chain(children) {
                // Wait in slices so a cancel is seen while an input stalls.
                let deadline = Instant::now() + timeout;
                let got = loop {
                    if cancel.load(Ordering::Acquire) || out.is_detached() {
                        return Err(cancelled());
                    }
                    match i.wait_for(need, Duration::from_millis(100)) {
                        Err(Error::Timeout(..)) if Instant::now() < deadline => continue,
                        r => break r?,
                    }
                };
                avail = avail.min(got);
            }
            let end = (off + chunk).min(off + (avail - off) / esz * esz);
            out.fill_with(end - off, |dst| match children.split_first() {
                Some((first, rest)) => {
                    combine_into(
                        t.op,
                        t.dtype,
                        dst,
                        own.bytes(off, end),
                        first.bytes(off, end),
                    );
                    for c in rest {
                        combine(t.op, t.dtype, dst, c.bytes(off, end));
                    }
                }
                None => dst.copy_from_slice(own.bytes(off, end)),
            })?;
            off = end;
        }
        if cancel.load(Ordering::Acquire) || out.is_detached() {
            return Err(cancelled());
        }
        self.publish(&t.out, t.size, true)?;
        Ok(())
    }
}
