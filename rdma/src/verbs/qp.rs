//! Reliable-connected queue pair: creation (its receives from a shared receive queue), state
//! changes, posting writes, sends, binds and reads.

use super::sys::{self, ibv_qp, ibv_qp_attr, ibv_qp_init_attr, ibv_send_wr, ibv_sge, Lib};
use super::{
    CompletionQueue, MemoryRegion, MemoryWindow, ProtectionDomain, SharedReceiveQueue, VerbsError,
};
use std::sync::{Arc, Mutex};

/// What one side tells the other to connect an RC queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// Active MTU of the port as the `ibv_mtu` enum value (1 = 256 ... 5 = 4096).
    pub mtu: u32,
}

/// Path and retry parameters of an RC connection.
#[derive(Debug, Clone, Copy)]
pub struct RcParams {
    pub port: u8,
    pub gid_index: u8,
    /// Use a global route header (always on RoCE).
    pub use_grh: bool,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout.
    pub timeout: u8,
    pub retry_cnt: u8,
    /// 7 = retry forever on receiver-not-ready.
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Error,
}

/// An RC queue pair. It keeps its PD, its CQ and every memory region it ever posted from
/// alive until it is destroyed, so the NIC never touches freed or deregistered memory.
pub struct QueuePair {
    qp: *mut ibv_qp,
    lib: &'static Lib,
    qpn: u32,
    state: Mutex<QpState>,
    // Dropped after the QP is destroyed in Drop::drop.
    in_use: Mutex<Vec<Arc<MemoryRegion>>>,
    /// The SRQ the receives come from (destroyed after the QP).
    _srq: Arc<SharedReceiveQueue>,
    _cq: Arc<CompletionQueue>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: posting and modifying a QP are thread-safe verbs; our own state is behind Mutexes.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl QueuePair {
    /// Creates an RC QP whose send and receive completions go to `cq` and whose receives
    /// come from `srq`.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        max_send_wr: u32,
        srq: &Arc<SharedReceiveQueue>,
    ) -> Result<QueuePair, VerbsError> {
        // SAFETY: ibv_qp_init_attr is plain old data; zero is valid (null pointers).
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = cq.cq;
        a.recv_cq = cq.cq;
        a.qp_type = sys::IBV_QPT_RC;
        a.sq_sig_all = 0;
        a.cap.max_send_wr = max_send_wr;
        a.cap.max_recv_wr = 0;
        a.srq = srq.raw();
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        a.cap.max_inline_data = 0;
        let lib = pd.context().lib;
        // SAFETY: the PD, the CQ and the SRQ are alive (we keep Arcs); `a` is fully initialised.
        let qp = unsafe { (lib.create_qp)(pd.pd, &mut a) };
        if qp.is_null() {
            return Err(VerbsError::errno("ibv_create_qp"));
        }
        // SAFETY: qp is valid.
        let qpn = unsafe { (*qp).qp_num };
        Ok(QueuePair {
            qp,
            lib,
            qpn,
            state: Mutex::new(QpState::Reset),
            in_use: Mutex::new(Vec::new()),
            _srq: srq.clone(),
            _cq: cq.clone(),
            _pd: pd.clone(),
        })
    }

    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    pub fn state(&self) -> QpState {
        *self.state.lock().unwrap()
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: u32, to: QpState) -> Result<(), VerbsError> {
        // SAFETY: the QP is alive and `attr` is initialised for every bit in `mask`.
        let rc = unsafe { (self.lib.modify_qp)(self.qp, attr, mask as i32) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_modify_qp", rc));
        }
        *self.state.lock().unwrap() = to;
        Ok(())
    }

    pub fn to_init(&self, p: &RcParams) -> Result<(), VerbsError> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = p.port;
        // Remote write only: an RDMA read from a peer fails at the QP, whatever its rkey.
        a.qp_access_flags = sys::IBV_ACCESS_LOCAL_WRITE | sys::IBV_ACCESS_REMOTE_WRITE;
        let m = sys::IBV_QP_STATE
            | sys::IBV_QP_PKEY_INDEX
            | sys::IBV_QP_PORT
            | sys::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut a, m, QpState::Init)
    }

    pub fn to_rtr(
        &self,
        p: &RcParams,
        local_mtu: u32,
        remote: &QpEndpoint,
    ) -> Result<(), VerbsError> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTR;
        a.path_mtu = local_mtu.min(remote.mtu).max(1);
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = p.min_rnr_timer;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = p.port;
        if p.use_grh {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.sgid_index = p.gid_index;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.flow_label = 0;
            a.ah_attr.grh.traffic_class = 0;
        }
        let m = sys::IBV_QP_STATE
            | sys::IBV_QP_AV
            | sys::IBV_QP_PATH_MTU
            | sys::IBV_QP_DEST_QPN
            | sys::IBV_QP_RQ_PSN
            | sys::IBV_QP_MAX_DEST_RD_ATOMIC
            | sys::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, m, QpState::Rtr)
    }

    pub fn to_rts(&self, p: &RcParams, psn: u32) -> Result<(), VerbsError> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTS;
        a.timeout = p.timeout;
        a.retry_cnt = p.retry_cnt;
        a.rnr_retry = p.rnr_retry;
        a.sq_psn = psn;
        a.max_rd_atomic = 1;
        let m = sys::IBV_QP_STATE
            | sys::IBV_QP_TIMEOUT
            | sys::IBV_QP_RETRY_CNT
            | sys::IBV_QP_RNR_RETRY
            | sys::IBV_QP_SQ_PSN
            | sys::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, m, QpState::Rts)
    }

    /// Moves the QP to the error state: outstanding work is flushed and the NIC stops
    /// accessing this QP's buffers; the peer sees its operations fail.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_ERR;
        self.modify(&mut a, sys::IBV_QP_STATE, QpState::Error)
    }

    fn keep(&self, mr: &Arc<MemoryRegion>) {
        let mut v = self.in_use.lock().unwrap();
        if !v.iter().any(|m| Arc::ptr_eq(m, mr)) {
            v.push(mr.clone());
        }
    }

    /// Posts one signaled RDMA write (with immediate data when `imm` is set) of
    /// `[offset, offset + len)` of `mr` to `remote_addr`/`rkey`. The QP keeps `mr` alive
    /// until it is destroyed; the caller must not modify the source bytes until the
    /// completion of `wr_id` (that affects only what the peer receives, not memory safety).
    #[allow(clippy::too_many_arguments)]
    pub fn post_write(
        &self,
        wr_id: u64,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    ) -> Result<(), VerbsError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= mr.len() as u64 => {}
            _ => {
                return Err(VerbsError::Invalid(format!(
                    "write source {offset}+{len} outside a region of {}",
                    mr.len()
                )))
            }
        }
        let opcode = match imm {
            Some(_) => sys::IBV_WR_RDMA_WRITE_WITH_IMM,
            None => sys::IBV_WR_RDMA_WRITE,
        };
        self.post_rdma(wr_id, opcode, mr, offset, len, remote_addr, rkey, imm)
    }

    /// Posts one signaled send with immediate data `imm` of `[offset, offset + len)` of `mr`
    /// into the peer's next receive. The QP keeps `mr` alive until it is destroyed; the
    /// caller must not modify the source bytes until the completion of `wr_id`.
    pub fn post_send_imm(
        &self,
        wr_id: u64,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        imm: u32,
    ) -> Result<(), VerbsError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= mr.len() as u64 => {}
            _ => {
                return Err(VerbsError::Invalid(format!(
                    "send source {offset}+{len} outside a region of {}",
                    mr.len()
                )))
            }
        }
        let send = sys::IBV_WR_SEND_WITH_IMM;
        self.post_rdma(wr_id, send, mr, offset, len, 0, 0, Some(imm))
    }

    /// Posts one signaled RDMA work request `opcode` between `[offset, offset + len)` of `mr`
    /// (checked by the caller to lie inside it) and `remote_addr`/`rkey`, with immediate data
    /// when `imm` is set. The QP keeps `mr` alive until it is destroyed.
    #[allow(clippy::too_many_arguments)]
    fn post_rdma(
        &self,
        wr_id: u64,
        opcode: std::ffi::c_uint,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    ) -> Result<(), VerbsError> {
        self.keep(mr);
        let mut sge = ibv_sge {
            addr: mr.addr() + offset,
            length: len,
            lkey: mr.lkey(),
        };
        // SAFETY: ibv_send_wr is plain old data; zero is valid (null pointers).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = if len == 0 { 0 } else { 1 };
        wr.send_flags = sys::IBV_SEND_SIGNALED;
        wr.opcode = opcode;
        if let Some(v) = imm {
            wr.imm.imm_data = v.to_be();
        }
        wr.wr.rdma = sys::ibv_wr_rdma { remote_addr, rkey };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wr` and `sge` live across the call (the provider copies
        // them into the send queue); the local range is inside `mr` (the callers check it),
        // kept alive above.
        let rc = unsafe { sys::post_send(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Posts one signaled bind of type 2 window `mw` over `[offset, offset + len)` of `mr`
    /// with remote write access, giving it key `rkey` (`mw.next_rkey()`). Once it has
    /// completed, the peer of this QP, and no other, may RDMA-write into that range with
    /// `rkey`; dropping `mw` withdraws that. `mr` must have been registered with
    /// [`super::Access::WindowsOnly`].
    pub fn post_bind(
        &self,
        wr_id: u64,
        mw: &mut MemoryWindow,
        rkey: u32,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u64,
    ) -> Result<(), VerbsError> {
        match offset.checked_add(len) {
            Some(end) if end <= mr.len() as u64 && len > 0 => {}
            _ => {
                return Err(VerbsError::Invalid(format!(
                    "window {offset}+{len} outside a region of {}",
                    mr.len()
                )))
            }
        }
        mw.hold(mr);
        self.keep(mr);
        // SAFETY: ibv_send_wr is plain old data; zero is valid (null pointers).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = sys::IBV_WR_BIND_MW;
        wr.send_flags = sys::IBV_SEND_SIGNALED;
        wr.bind_mw_tso.bind_mw = sys::ibv_wr_bind_mw {
            mw: mw.raw(),
            rkey,
            bind_info: sys::ibv_mw_bind_info {
                mr: mr.raw(),
                addr: mr.addr() + offset,
                length: len,
                mw_access_flags: sys::IBV_ACCESS_REMOTE_WRITE,
            },
        };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP, the window and the region are alive (the window and the QP hold the
        // region from here on); the range is inside the region, checked above.
        let rc = unsafe { sys::post_send(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Posts one signaled RDMA read of `len` bytes at `remote_addr`/`rkey` into
    /// `[offset, offset + len)` of `mr`. Phalanx never reads from peers (every region and
    /// window it exposes refuses reads); this exists to show that they are refused.
    #[doc(hidden)]
    pub fn post_read(
        &self,
        wr_id: u64,
        mr: &Arc<MemoryRegion>,
        offset: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), VerbsError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= mr.len() as u64 => {}
            _ => return Err(VerbsError::Invalid("read target outside its region".into())),
        }
        let read = sys::IBV_WR_RDMA_READ;
        self.post_rdma(wr_id, read, mr, offset, len, remote_addr, rkey, None)
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: nobody else holds the QP (we are in drop). After destroy returns the NIC
        // no longer accesses any buffer of this QP; `in_use`, the CQ and the PD are released
        // only after this, by field drops.
        unsafe { (self.lib.destroy_qp)(self.qp) };
    }
}
