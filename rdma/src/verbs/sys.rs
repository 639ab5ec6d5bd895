//! The verbs ABI Phalanx uses, declared by hand, and `libibverbs.so.1` loaded at run time.
//!
//! Nothing here links against libibverbs: [`lib`] opens `libibverbs.so.1` with `dlopen` the
//! first time verbs are needed and resolves every exported function once, by symbol version
//! (`dlvsym`, e.g. `ibv_reg_mr@IBVERBS_1.1`, the version verbs.h binds to today). The four
//! calls verbs.h implements as `static inline` functions (`ibv_post_send`,
//! `ibv_post_srq_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) go through the context's ops
//! table exactly as verbs.h does ([`post_send`], [`post_srq_recv`], [`poll_cq`],
//! [`req_notify_cq`]).
//!
//! The structures are `#[repr(C)]` copies of rdma-core's `infiniband/verbs.h` (x86-64 and
//! other LP64 Linux targets), limited to what Phalanx touches; handles Phalanx never looks
//! into (`ibv_device`, `ibv_ah`) are opaque. The `layout-check` feature
//! (`tests/layout.rs`) checks size, alignment and every field offset of each structure, and
//! the value of each constant, against `rdma-sys` (bindgen over the system headers) and
//! against the C compiler.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

// ---------------------------------------------------------------------------------------
// Opaque handles.

/// `struct ibv_device` (only ever handled by pointer).
#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}
/// `struct ibv_ah` (only ever a pointer inside an unused union member).
#[repr(C)]
pub struct ibv_ah {
    _opaque: [u8; 0],
}

// ---------------------------------------------------------------------------------------
// Structures.

/// An ops-table slot Phalanx never calls (declared for the layout only).
pub type UnusedOp = Option<unsafe extern "C" fn()>;

/// `struct ibv_context_ops`: the provider's function table embedded in every context; the
/// inline verbs of verbs.h call through it.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: UnusedOp,
    pub _compat_query_port: UnusedOp,
    pub _compat_alloc_pd: UnusedOp,
    pub _compat_dealloc_pd: UnusedOp,
    pub _compat_reg_mr: UnusedOp,
    pub _compat_rereg_mr: UnusedOp,
    pub _compat_dereg_mr: UnusedOp,
    pub alloc_mw: Option<unsafe extern "C" fn(*mut ibv_pd, c_uint) -> *mut ibv_mw>,
    pub bind_mw: UnusedOp,
    pub dealloc_mw: Option<unsafe extern "C" fn(*mut ibv_mw) -> c_int>,
    pub _compat_create_cq: UnusedOp,
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    pub _compat_cq_event: UnusedOp,
    pub _compat_resize_cq: UnusedOp,
    pub _compat_destroy_cq: UnusedOp,
    pub _compat_create_srq: UnusedOp,
    pub _compat_modify_srq: UnusedOp,
    pub _compat_query_srq: UnusedOp,
    pub _compat_destroy_srq: UnusedOp,
    pub post_srq_recv: Option<
        unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int,
    >,
    pub _compat_create_qp: UnusedOp,
    pub _compat_query_qp: UnusedOp,
    pub _compat_modify_qp: UnusedOp,
    pub _compat_destroy_qp: UnusedOp,
    pub post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    pub _compat_create_ah: UnusedOp,
    pub _compat_destroy_ah: UnusedOp,
    pub _compat_attach_mcast: UnusedOp,
    pub _compat_detach_mcast: UnusedOp,
    pub _compat_async_event: UnusedOp,
}

/// `struct ibv_context`: an open device.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mw`: a memory window (type 2 here: bound to one QP by a bind work request).
#[repr(C)]
pub struct ibv_mw {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub rkey: u32,
    pub handle: u32,
    pub type_: c_uint,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_device_attr`.
#[repr(C)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`.
#[repr(C)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// The `global` member of `union ibv_gid`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_gid_global {
    pub subnet_prefix: u64,
    pub interface_id: u64,
}

/// `union ibv_gid`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_gid {
    pub raw: [u8; 16],
    pub global: ibv_gid_global,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_srq`: a shared receive queue (its `context` leads to the ops table).
#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_srq_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

/// `struct ibv_srq_init_attr`.
#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The anonymous `imm_data` / `invalidate_rkey` union of `ibv_send_wr` and `ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_imm_union {
    /// Immediate data, network byte order.
    pub imm_data: u32,
    pub invalidated_rkey: u32,
}

/// `wr.rdma` of `ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `wr.atomic` of `ibv_send_wr` (unused; sizes the union).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `wr.ud` of `ibv_send_wr` (unused; sizes the union).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// The `wr` union of `ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_wr_union {
    pub rdma: ibv_wr_rdma,
    pub atomic: ibv_wr_atomic,
    pub ud: ibv_wr_ud,
}

/// The `qp_type` union of `ibv_send_wr` (its only member, `xrc.remote_srqn`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wr_xrc {
    pub remote_srqn: u32,
}

/// `struct ibv_mw_bind_info`: what a bind work request exposes through a window.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_mw_bind_info {
    pub mr: *mut ibv_mr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: c_uint,
}

/// `bind_mw` member of the last union of `ibv_send_wr` (`IBV_WR_BIND_MW`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wr_bind_mw {
    pub mw: *mut ibv_mw,
    pub rkey: u32,
    pub bind_info: ibv_mw_bind_info,
}

/// `tso` member of the last union of `ibv_send_wr` (unused).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wr_tso {
    pub hdr: *mut c_void,
    pub hdr_sz: u16,
    pub mss: u16,
}

/// The anonymous `bind_mw` / `tso` union of `ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_wr_bind_mw_tso {
    pub bind_mw: ibv_wr_bind_mw,
    pub tso: ibv_wr_tso,
}

/// `struct ibv_send_wr`.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    pub imm: ibv_imm_union,
    pub wr: ibv_wr_union,
    pub qp_type: ibv_wr_xrc,
    pub bind_mw_tso: ibv_wr_bind_mw_tso,
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm: ibv_imm_union,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

// ---------------------------------------------------------------------------------------
// Constants (enum values of verbs.h that Phalanx uses).

pub const IBV_WC_SUCCESS: c_uint = 0;
/// `IBV_WC_RECV`: receive opcodes of `ibv_wc.opcode` have this bit.
pub const IBV_WC_RECV: c_uint = 1 << 7;
/// `IBV_WC_RECV_RDMA_WITH_IMM`: the receive side of a write-with-immediate.
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = IBV_WC_RECV + 1;
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;

pub const IBV_ACCESS_LOCAL_WRITE: c_uint = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_uint = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_uint = 1 << 2;
pub const IBV_ACCESS_MW_BIND: c_uint = 1 << 4;

/// `IBV_MW_TYPE_2`: a window bound by a work request on one QP, usable only through it.
pub const IBV_MW_TYPE_2: c_uint = 2;

pub const IBV_PORT_NOP: c_uint = 0;
pub const IBV_PORT_DOWN: c_uint = 1;
pub const IBV_PORT_INIT: c_uint = 2;
pub const IBV_PORT_ARMED: c_uint = 3;
pub const IBV_PORT_ACTIVE: c_uint = 4;
pub const IBV_PORT_ACTIVE_DEFER: c_uint = 5;

pub const IBV_MTU_256: c_uint = 1;
pub const IBV_MTU_4096: c_uint = 5;

pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

pub const IBV_QPT_RC: c_uint = 2;

pub const IBV_QPS_RESET: c_uint = 0;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_QPS_ERR: c_uint = 6;

pub const IBV_QP_STATE: c_uint = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_uint = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_uint = 1 << 4;
pub const IBV_QP_PORT: c_uint = 1 << 5;
pub const IBV_QP_AV: c_uint = 1 << 7;
pub const IBV_QP_PATH_MTU: c_uint = 1 << 8;
pub const IBV_QP_TIMEOUT: c_uint = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_uint = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_uint = 1 << 11;
pub const IBV_QP_RQ_PSN: c_uint = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_uint = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_uint = 1 << 15;
pub const IBV_QP_SQ_PSN: c_uint = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_uint = 1 << 17;
pub const IBV_QP_DEST_QPN: c_uint = 1 << 20;

pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_WR_SEND_WITH_IMM: c_uint = 3;
pub const IBV_WR_RDMA_READ: c_uint = 4;
pub const IBV_WR_BIND_MW: c_uint = 8;

pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;

// ---------------------------------------------------------------------------------------
// The library.

/// The file name `dlopen` looks for (the soname of rdma-core's libibverbs, ABI 1).
pub const LIBIBVERBS: &str = "libibverbs.so.1";

/// Overrides the library `dlopen` opens (a path or another file name). Meant for tests (a
/// name that does not exist shows the "not found" path) and for unusual installations.
pub const LIBIBVERBS_ENV: &str = "PHALANX_LIBIBVERBS";

/// The exported functions, resolved once by version.
pub struct Lib {
    /// What was opened (file name or path), for messages.
    pub name: String,
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    /// Called with a full `ibv_port_attr` (what verbs.h's inline `ibv_query_port` passes).
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    pub create_srq: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq,
    pub destroy_srq: unsafe extern "C" fn(*mut ibv_srq) -> c_int,
    pub wc_status_str: unsafe extern "C" fn(c_uint) -> *const c_char,
}

/// Why the library could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// `dlopen` failed: the library is not installed (or not loadable); `detail` is dlerror.
    NotFound { name: String, detail: String },
    /// The library is there but lacks a symbol at the version we bind to.
    Symbol {
        name: String,
        symbol: String,
        detail: String,
    },
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // Always the soname (what the user installs); dlerror names what was tried.
            LoadError::NotFound { detail, .. } => write!(
                f,
                "{LIBIBVERBS} not found: install rdma-core / libibverbs1 (dlopen: {detail})"
            ),
            LoadError::Symbol {
                name,
                symbol,
                detail,
            } => write!(
                f,
                "{name} has no {symbol}: rdma-core too old or not libibverbs (dlvsym: {detail})"
            ),
        }
    }
}

impl std::error::Error for LoadError {}

/// The text of the last `dlerror` (one line), or a placeholder.
fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call
    // on this thread; we copy it right away.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        return "no detail".into();
    }
    // SAFETY: non-null, NUL-terminated (see above).
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
    s.replace('\n', " ")
}

/// Reinterprets a non-null symbol address as the function pointer type `F`.
///
/// # Safety
/// `p` is the address of a function whose C signature is `F`'s.
unsafe fn fn_from_sym<F: Copy>(p: *mut c_void) -> F {
    // A data pointer and a function pointer have the same size and representation on Linux.
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked); the caller guarantees the signature.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

impl Lib {
    /// Opens `name` (a file name searched the usual way, or a path) and resolves every
    /// function. The handle is never closed: the functions stay valid for the process.
    pub fn open(name: &str) -> Result<Lib, LoadError> {
        let not_found = |detail: String| LoadError::NotFound {
            name: name.to_string(),
            detail,
        };
        let cname = CString::new(name).map_err(|_| not_found("NUL in the name".into()))?;
        // SAFETY: a valid C string; RTLD_NOW resolves everything up front, so a broken library
        // fails here rather than at a later call. libibverbs' constructors are safe to run.
        let h = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(not_found(dlerror_text()));
        }
        let sym = |symbol: &str, version: &str| -> Result<*mut c_void, LoadError> {
            let s = CString::new(symbol).expect("no NUL");
            let v = CString::new(version).expect("no NUL");
            // SAFETY: h is a live handle (never closed); both strings are valid C strings.
            let p = unsafe { libc::dlvsym(h, s.as_ptr(), v.as_ptr()) };
            if p.is_null() {
                return Err(LoadError::Symbol {
                    name: name.to_string(),
                    symbol: format!("{symbol}@{version}"),
                    detail: dlerror_text(),
                });
            }
            Ok(p)
        };
        macro_rules! f {
            ($sym:literal, $ver:literal) => {{
                let p = sym($sym, $ver)?;
                // SAFETY: the symbol at this version has exactly the C signature of the field
                // it is assigned to (verbs.h of rdma-core); fn_from_sym checks the size.
                unsafe { fn_from_sym(p) }
            }};
        }
        Ok(Lib {
            name: name.to_string(),
            get_device_list: f!("ibv_get_device_list", "IBVERBS_1.1"),
            free_device_list: f!("ibv_free_device_list", "IBVERBS_1.1"),
            get_device_name: f!("ibv_get_device_name", "IBVERBS_1.1"),
            open_device: f!("ibv_open_device", "IBVERBS_1.1"),
            close_device: f!("ibv_close_device", "IBVERBS_1.1"),
            query_device: f!("ibv_query_device", "IBVERBS_1.1"),
            query_port: f!("ibv_query_port", "IBVERBS_1.1"),
            query_gid: f!("ibv_query_gid", "IBVERBS_1.1"),
            alloc_pd: f!("ibv_alloc_pd", "IBVERBS_1.1"),
            dealloc_pd: f!("ibv_dealloc_pd", "IBVERBS_1.1"),
            reg_mr: f!("ibv_reg_mr", "IBVERBS_1.1"),
            dereg_mr: f!("ibv_dereg_mr", "IBVERBS_1.1"),
            create_comp_channel: f!("ibv_create_comp_channel", "IBVERBS_1.0"),
            destroy_comp_channel: f!("ibv_destroy_comp_channel", "IBVERBS_1.0"),
            create_cq: f!("ibv_create_cq", "IBVERBS_1.1"),
            destroy_cq: f!("ibv_destroy_cq", "IBVERBS_1.1"),
            get_cq_event: f!("ibv_get_cq_event", "IBVERBS_1.1"),
            ack_cq_events: f!("ibv_ack_cq_events", "IBVERBS_1.1"),
            create_qp: f!("ibv_create_qp", "IBVERBS_1.1"),
            modify_qp: f!("ibv_modify_qp", "IBVERBS_1.1"),
            destroy_qp: f!("ibv_destroy_qp", "IBVERBS_1.1"),
            create_srq: f!("ibv_create_srq", "IBVERBS_1.1"),
            destroy_srq: f!("ibv_destroy_srq", "IBVERBS_1.1"),
            wc_status_str: f!("ibv_wc_status_str", "IBVERBS_1.1"),
        })
    }
}

/// The library name to open: `$PHALANX_LIBIBVERBS` if set and not empty, else
/// [`LIBIBVERBS`].
pub fn lib_name() -> String {
    std::env::var(LIBIBVERBS_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| LIBIBVERBS.to_string())
}

/// The process-wide library, opened on first use (a failure is remembered too).
pub fn lib() -> Result<&'static Lib, LoadError> {
    static LIB: OnceLock<Result<Lib, LoadError>> = OnceLock::new();
    LIB.get_or_init(|| Lib::open(&lib_name()))
        .as_ref()
        .map_err(Clone::clone)
}

// ---------------------------------------------------------------------------------------
// The inline verbs of verbs.h, through the ops table.

/// `ibv_poll_cq`: `cq->context->ops.poll_cq(cq, n, wc)`.
///
/// # Safety
/// `cq` is a live CQ and `wc` has room for `n` entries.
#[inline]
pub unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a live CQ points at its live context, whose ops table the provider filled in.
    match unsafe { (*(*cq).context).ops.poll_cq } {
        // SAFETY: the caller's contract is poll_cq's.
        Some(f) => unsafe { f(cq, n, wc) },
        None => -libc::EOPNOTSUPP,
    }
}

/// `ibv_req_notify_cq`: `cq->context->ops.req_notify_cq(cq, solicited_only)`.
///
/// # Safety
/// `cq` is a live CQ.
#[inline]
pub unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: as in poll_cq.
    match unsafe { (*(*cq).context).ops.req_notify_cq } {
        // SAFETY: the CQ is live.
        Some(f) => unsafe { f(cq, solicited_only) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_post_send`: `qp->context->ops.post_send(qp, wr, bad)`.
///
/// # Safety
/// `qp` is a live QP; `wr` is a valid chain whose buffers are registered and live.
#[inline]
pub unsafe fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: a live QP points at its live context, whose ops table the provider filled in.
    match unsafe { (*(*qp).context).ops.post_send } {
        // SAFETY: the caller's contract is post_send's.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_post_srq_recv`: `srq->context->ops.post_srq_recv(srq, wr, bad)`.
///
/// # Safety
/// `srq` is a live SRQ; `wr` is a valid chain whose buffers are registered and live.
#[inline]
pub unsafe fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: a live SRQ points at its live context, whose ops table the provider filled in.
    match unsafe { (*(*srq).context).ops.post_srq_recv } {
        // SAFETY: the caller's contract is post_srq_recv's.
        Some(f) => unsafe { f(srq, wr, bad) },
        None => libc::EOPNOTSUPP,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_one_clear_line() {
        let e = Lib::open("libibverbs-phalanx-test-missing.so.1")
            .err()
            .expect("no such library");
        let s = e.to_string();
        assert!(
            s.starts_with("libibverbs.so.1 not found: install rdma-core / libibverbs1 (dlopen: "),
            "{s}"
        );
        assert!(
            s.contains("libibverbs-phalanx-test-missing.so.1"),
            "dlerror: {s}"
        );
        assert!(!s.contains('\n'), "{s}");
    }

    #[test]
    fn a_library_without_the_verbs_symbols_is_named() {
        // libc is on every machine and has no verbs: the first symbol is reported missing.
        match Lib::open("libc.so.6") {
            Err(e @ LoadError::Symbol { .. }) => {
                let s = e.to_string();
                assert!(
                    s.starts_with("libc.so.6 has no ibv_get_device_list@IBVERBS_1.1"),
                    "{s}"
                );
                assert!(s.contains("dlvsym: "), "{s}");
            }
            Err(e) => panic!("expected a missing symbol, got {e}"),
            Ok(_) => panic!("libc is not libibverbs"),
        }
    }

    #[test]
    fn the_installed_library_resolves_every_symbol() {
        match Lib::open(LIBIBVERBS) {
            Ok(l) => assert_eq!(l.name, LIBIBVERBS),
            Err(LoadError::NotFound { .. }) => eprintln!("libibverbs.so.1 not installed: skipped"),
            Err(e) => panic!("{e}"),
        }
    }
}
