//! The hand-declared verbs ABI (`phalanx_rdma::verbs::sys`) against two references:
//! `rdma-sys` (bindgen over the system's `infiniband/verbs.h`, plus the few structures with
//! anonymous unions that rdma-sys declares itself) and the C compiler (a small program built
//! against the same header prints `sizeof`, `_Alignof`, `offsetof` and the constants).
//! Every structure's size and alignment, every field's offset and every constant's value must
//! equal both. Needs libibverbs-dev, libclang and a C compiler:
//!
//! `cargo test --release -p phalanx-rdma --features layout-check --test layout -- --nocapture`
#![cfg(feature = "layout-check")]

use phalanx_rdma::verbs::sys;
use rdma_sys as rs;
use std::mem::{align_of, offset_of, size_of};

/// One checked item: its name, our value, rdma-sys's value (where rdma-sys has it) and the C
/// expression whose value it must equal.
struct Item {
    name: String,
    ours: u64,
    theirs: Option<u64>,
    c_expr: String,
}

#[derive(Default)]
struct Checks {
    items: Vec<Item>,
}

impl Checks {
    fn add(&mut self, name: String, ours: u64, theirs: Option<u64>, c_expr: String) {
        self.items.push(Item {
            name,
            ours,
            theirs,
            c_expr,
        });
    }
}

/// `layout!(checks, ours, theirs, "C type", { field => their_field : "c.field", ... })`:
/// size, alignment and every listed field offset.
macro_rules! layout {
    ($c:expr, $ours:ty, $theirs:ty, $cty:literal, { $($f:ident $(. $fs:ident)* => $g:ident $(. $gs:ident)* : $cf:literal),* $(,)? }) => {{
        let name = stringify!($ours);
        $c.add(format!("size_of {name}"), size_of::<$ours>() as u64,
            Some(size_of::<$theirs>() as u64), format!("sizeof({})", $cty));
        $c.add(format!("align_of {name}"), align_of::<$ours>() as u64,
            Some(align_of::<$theirs>() as u64), format!("_Alignof({})", $cty));
        $(
            $c.add(
                format!("offset_of {name}.{}", stringify!($f $(. $fs)*)),
                offset_of!($ours, $f $(. $fs)*) as u64,
                Some(offset_of!($theirs, $g $(. $gs)*) as u64),
                format!("offsetof({}, {})", $cty, $cf),
            );
        )*
    }};
}

/// `constant!(checks, OURS, Some(theirs) | None)`: the C enumerator of the same name.
macro_rules! constant {
    ($c:expr, $name:ident, $theirs:expr) => {
        $c.add(
            format!("const {}", stringify!($name)),
            sys::$name as u64,
            $theirs.map(|v| v as u64),
            format!("(long long){}", stringify!($name)),
        )
    };
}

fn checks() -> Checks {
    let mut c = Checks::default();
    layout!(c, sys::ibv_context_ops, rs::ibv_context_ops, "struct ibv_context_ops", {
        _compat_query_device => _compat_query_device : "_compat_query_device",
        _compat_query_port => _compat_query_port : "_compat_query_port",
        _compat_alloc_pd => _compat_alloc_pd : "_compat_alloc_pd",
        _compat_dealloc_pd => _compat_dealloc_pd : "_compat_dealloc_pd",
        _compat_reg_mr => _compat_reg_mr : "_compat_reg_mr",
        _compat_rereg_mr => _compat_rereg_mr : "_compat_rereg_mr",
        _compat_dereg_mr => _compat_dereg_mr : "_compat_dereg_mr",
        alloc_mw => alloc_mw : "alloc_mw",
        bind_mw => bind_mw : "bind_mw",
        dealloc_mw => dealloc_mw : "dealloc_mw",
        _compat_create_cq => _compat_create_cq : "_compat_create_cq",
        poll_cq => poll_cq : "poll_cq",
        req_notify_cq => req_notify_cq : "req_notify_cq",
        _compat_cq_event => _compat_cq_event : "_compat_cq_event",
        _compat_resize_cq => _compat_resize_cq : "_compat_resize_cq",
        _compat_destroy_cq => _compat_destroy_cq : "_compat_destroy_cq",
        _compat_create_srq => _compat_create_srq : "_compat_create_srq",
        _compat_modify_srq => _compat_modify_srq : "_compat_modify_srq",
        _compat_query_srq => _compat_query_srq : "_compat_query_srq",
        _compat_destroy_srq => _compat_destroy_srq : "_compat_destroy_srq",
        post_srq_recv => post_srq_recv : "post_srq_recv",
        _compat_create_qp => _compat_create_qp : "_compat_create_qp",
        _compat_query_qp => _compat_query_qp : "_compat_query_qp",
        _compat_modify_qp => _compat_modify_qp : "_compat_modify_qp",
        _compat_destroy_qp => _compat_destroy_qp : "_compat_destroy_qp",
        post_send => post_send : "post_send",
        post_recv => post_recv : "post_recv",
        _compat_create_ah => _compat_create_ah : "_compat_create_ah",
        _compat_destroy_ah => _compat_destroy_ah : "_compat_destroy_ah",
        _compat_attach_mcast => _compat_attach_mcast : "_compat_attach_mcast",
        _compat_detach_mcast => _compat_detach_mcast : "_compat_detach_mcast",
        _compat_async_event => _compat_async_event : "_compat_async_event",
    });
    layout!(c, sys::ibv_context, rs::ibv_context, "struct ibv_context", {
        device => device : "device",
        ops => ops : "ops",
        ops.poll_cq => ops.poll_cq : "ops.poll_cq",
        ops.req_notify_cq => ops.req_notify_cq : "ops.req_notify_cq",
        ops.post_send => ops.post_send : "ops.post_send",
        ops.post_recv => ops.post_recv : "ops.post_recv",
        cmd_fd => cmd_fd : "cmd_fd",
        async_fd => async_fd : "async_fd",
        num_comp_vectors => num_comp_vectors : "num_comp_vectors",
        mutex => mutex : "mutex",
        abi_compat => abi_compat : "abi_compat",
    });
    layout!(c, sys::ibv_pd, rs::ibv_pd, "struct ibv_pd", {
        context => context : "context",
        handle => handle : "handle",
    });
    layout!(c, sys::ibv_comp_channel, rs::ibv_comp_channel, "struct ibv_comp_channel", {
        context => context : "context",
        fd => fd : "fd",
        refcnt => refcnt : "refcnt",
    });
    layout!(c, sys::ibv_cq, rs::ibv_cq, "struct ibv_cq", {
        context => context : "context",
        channel => channel : "channel",
        cq_context => cq_context : "cq_context",
        handle => handle : "handle",
        cqe => cqe : "cqe",
        mutex => mutex : "mutex",
        cond => cond : "cond",
        comp_events_completed => comp_events_completed : "comp_events_completed",
        async_events_completed => async_events_completed : "async_events_completed",
    });
    layout!(c, sys::ibv_qp, rs::ibv_qp, "struct ibv_qp", {
        context => context : "context",
        qp_context => qp_context : "qp_context",
        pd => pd : "pd",
        send_cq => send_cq : "send_cq",
        recv_cq => recv_cq : "recv_cq",
        srq => srq : "srq",
        handle => handle : "handle",
        qp_num => qp_num : "qp_num",
        state => state : "state",
        qp_type => qp_type : "qp_type",
        mutex => mutex : "mutex",
        cond => cond : "cond",
        events_completed => events_completed : "events_completed",
    });
    layout!(c, sys::ibv_mr, rs::ibv_mr, "struct ibv_mr", {
        context => context : "context",
        pd => pd : "pd",
        addr => addr : "addr",
        length => length : "length",
        handle => handle : "handle",
        lkey => lkey : "lkey",
        rkey => rkey : "rkey",
    });
    layout!(c, sys::ibv_mw, rs::ibv_mw, "struct ibv_mw", {
        context => context : "context",
        pd => pd : "pd",
        rkey => rkey : "rkey",
        handle => handle : "handle",
        type_ => type_ : "type",
    });
    layout!(c, sys::ibv_device_attr, rs::ibv_device_attr, "struct ibv_device_attr", {
        fw_ver => fw_ver : "fw_ver",
        node_guid => node_guid : "node_guid",
        sys_image_guid => sys_image_guid : "sys_image_guid",
        max_mr_size => max_mr_size : "max_mr_size",
        page_size_cap => page_size_cap : "page_size_cap",
        vendor_id => vendor_id : "vendor_id",
        vendor_part_id => vendor_part_id : "vendor_part_id",
        hw_ver => hw_ver : "hw_ver",
        max_qp => max_qp : "max_qp",
        max_qp_wr => max_qp_wr : "max_qp_wr",
        device_cap_flags => device_cap_flags : "device_cap_flags",
        max_sge => max_sge : "max_sge",
        max_sge_rd => max_sge_rd : "max_sge_rd",
        max_cq => max_cq : "max_cq",
        max_cqe => max_cqe : "max_cqe",
        max_mr => max_mr : "max_mr",
        max_pd => max_pd : "max_pd",
        max_qp_rd_atom => max_qp_rd_atom : "max_qp_rd_atom",
        max_ee_rd_atom => max_ee_rd_atom : "max_ee_rd_atom",
        max_res_rd_atom => max_res_rd_atom : "max_res_rd_atom",
        max_qp_init_rd_atom => max_qp_init_rd_atom : "max_qp_init_rd_atom",
        max_ee_init_rd_atom => max_ee_init_rd_atom : "max_ee_init_rd_atom",
        atomic_cap => atomic_cap : "atomic_cap",
        max_ee => max_ee : "max_ee",
        max_rdd => max_rdd : "max_rdd",
        max_mw => max_mw : "max_mw",
        max_raw_ipv6_qp => max_raw_ipv6_qp : "max_raw_ipv6_qp",
        max_raw_ethy_qp => max_raw_ethy_qp : "max_raw_ethy_qp",
        max_mcast_grp => max_mcast_grp : "max_mcast_grp",
        max_mcast_qp_attach => max_mcast_qp_attach : "max_mcast_qp_attach",
        max_total_mcast_qp_attach => max_total_mcast_qp_attach : "max_total_mcast_qp_attach",
        max_ah => max_ah : "max_ah",
        max_fmr => max_fmr : "max_fmr",
        max_map_per_fmr => max_map_per_fmr : "max_map_per_fmr",
        max_srq => max_srq : "max_srq",
        max_srq_wr => max_srq_wr : "max_srq_wr",
        max_srq_sge => max_srq_sge : "max_srq_sge",
        max_pkeys => max_pkeys : "max_pkeys",
        local_ca_ack_delay => local_ca_ack_delay : "local_ca_ack_delay",
        phys_port_cnt => phys_port_cnt : "phys_port_cnt",
    });
    layout!(c, sys::ibv_port_attr, rs::ibv_port_attr, "struct ibv_port_attr", {
        state => state : "state",
        max_mtu => max_mtu : "max_mtu",
        active_mtu => active_mtu : "active_mtu",
        gid_tbl_len => gid_tbl_len : "gid_tbl_len",
        port_cap_flags => port_cap_flags : "port_cap_flags",
        max_msg_sz => max_msg_sz : "max_msg_sz",
        bad_pkey_cntr => bad_pkey_cntr : "bad_pkey_cntr",
        qkey_viol_cntr => qkey_viol_cntr : "qkey_viol_cntr",
        pkey_tbl_len => pkey_tbl_len : "pkey_tbl_len",
        lid => lid : "lid",
        sm_lid => sm_lid : "sm_lid",
        lmc => lmc : "lmc",
        max_vl_num => max_vl_num : "max_vl_num",
        sm_sl => sm_sl : "sm_sl",
        subnet_timeout => subnet_timeout : "subnet_timeout",
        init_type_reply => init_type_reply : "init_type_reply",
        active_width => active_width : "active_width",
        active_speed => active_speed : "active_speed",
        phys_state => phys_state : "phys_state",
        link_layer => link_layer : "link_layer",
        flags => flags : "flags",
        port_cap_flags2 => port_cap_flags2 : "port_cap_flags2",
    });
    layout!(c, sys::ibv_gid, rs::ibv_gid, "union ibv_gid", {
        raw => raw : "raw",
        global => global : "global",
        global.subnet_prefix => global.subnet_prefix : "global.subnet_prefix",
        global.interface_id => global.interface_id : "global.interface_id",
    });
    layout!(c, sys::ibv_global_route, rs::ibv_global_route, "struct ibv_global_route", {
        dgid => dgid : "dgid",
        flow_label => flow_label : "flow_label",
        sgid_index => sgid_index : "sgid_index",
        hop_limit => hop_limit : "hop_limit",
        traffic_class => traffic_class : "traffic_class",
    });
    layout!(c, sys::ibv_ah_attr, rs::ibv_ah_attr, "struct ibv_ah_attr", {
        grh => grh : "grh",
        grh.dgid => grh.dgid : "grh.dgid",
        grh.flow_label => grh.flow_label : "grh.flow_label",
        grh.sgid_index => grh.sgid_index : "grh.sgid_index",
        grh.hop_limit => grh.hop_limit : "grh.hop_limit",
        grh.traffic_class => grh.traffic_class : "grh.traffic_class",
        dlid => dlid : "dlid",
        sl => sl : "sl",
        src_path_bits => src_path_bits : "src_path_bits",
        static_rate => static_rate : "static_rate",
        is_global => is_global : "is_global",
        port_num => port_num : "port_num",
    });
    layout!(c, sys::ibv_qp_cap, rs::ibv_qp_cap, "struct ibv_qp_cap", {
        max_send_wr => max_send_wr : "max_send_wr",
        max_recv_wr => max_recv_wr : "max_recv_wr",
        max_send_sge => max_send_sge : "max_send_sge",
        max_recv_sge => max_recv_sge : "max_recv_sge",
        max_inline_data => max_inline_data : "max_inline_data",
    });
    layout!(c, sys::ibv_srq, rs::ibv_srq, "struct ibv_srq", {
        context => context : "context",
        srq_context => srq_context : "srq_context",
        pd => pd : "pd",
        handle => handle : "handle",
        mutex => mutex : "mutex",
        cond => cond : "cond",
        events_completed => events_completed : "events_completed",
    });
    layout!(c, sys::ibv_srq_attr, rs::ibv_srq_attr, "struct ibv_srq_attr", {
        max_wr => max_wr : "max_wr",
        max_sge => max_sge : "max_sge",
        srq_limit => srq_limit : "srq_limit",
    });
    layout!(c, sys::ibv_srq_init_attr, rs::ibv_srq_init_attr, "struct ibv_srq_init_attr", {
        srq_context => srq_context : "srq_context",
        attr => attr : "attr",
    });
    layout!(c, sys::ibv_qp_init_attr, rs::ibv_qp_init_attr, "struct ibv_qp_init_attr", {
        qp_context => qp_context : "qp_context",
        send_cq => send_cq : "send_cq",
        recv_cq => recv_cq : "recv_cq",
        srq => srq : "srq",
        cap => cap : "cap",
        qp_type => qp_type : "qp_type",
        sq_sig_all => sq_sig_all : "sq_sig_all",
    });
    layout!(c, sys::ibv_qp_attr, rs::ibv_qp_attr, "struct ibv_qp_attr", {
        qp_state => qp_state : "qp_state",
        cur_qp_state => cur_qp_state : "cur_qp_state",
        path_mtu => path_mtu : "path_mtu",
        path_mig_state => path_mig_state : "path_mig_state",
        qkey => qkey : "qkey",
        rq_psn => rq_psn : "rq_psn",
        sq_psn => sq_psn : "sq_psn",
        dest_qp_num => dest_qp_num : "dest_qp_num",
        qp_access_flags => qp_access_flags : "qp_access_flags",
        cap => cap : "cap",
        ah_attr => ah_attr : "ah_attr",
        ah_attr.grh.dgid => ah_attr.grh.dgid : "ah_attr.grh.dgid",
        ah_attr.grh.sgid_index => ah_attr.grh.sgid_index : "ah_attr.grh.sgid_index",
        ah_attr.dlid => ah_attr.dlid : "ah_attr.dlid",
        ah_attr.is_global => ah_attr.is_global : "ah_attr.is_global",
        ah_attr.port_num => ah_attr.port_num : "ah_attr.port_num",
        alt_ah_attr => alt_ah_attr : "alt_ah_attr",
        pkey_index => pkey_index : "pkey_index",
        alt_pkey_index => alt_pkey_index : "alt_pkey_index",
        en_sqd_async_notify => en_sqd_async_notify : "en_sqd_async_notify",
        sq_draining => sq_draining : "sq_draining",
        max_rd_atomic => max_rd_atomic : "max_rd_atomic",
        max_dest_rd_atomic => max_dest_rd_atomic : "max_dest_rd_atomic",
        min_rnr_timer => min_rnr_timer : "min_rnr_timer",
        port_num => port_num : "port_num",
        timeout => timeout : "timeout",
        retry_cnt => retry_cnt : "retry_cnt",
        rnr_retry => rnr_retry : "rnr_retry",
        alt_port_num => alt_port_num : "alt_port_num",
        alt_timeout => alt_timeout : "alt_timeout",
        rate_limit => rate_limit : "rate_limit",
    });
    layout!(c, sys::ibv_sge, rs::ibv_sge, "struct ibv_sge", {
        addr => addr : "addr",
        length => length : "length",
        lkey => lkey : "lkey",
    });
    layout!(c, sys::ibv_mw_bind_info, rs::ibv_mw_bind_info, "struct ibv_mw_bind_info", {
        mr => mr : "mr",
        addr => addr : "addr",
        length => length : "length",
        mw_access_flags => mw_access_flags : "mw_access_flags",
    });
    layout!(c, sys::ibv_send_wr, rs::ibv_send_wr, "struct ibv_send_wr", {
        wr_id => wr_id : "wr_id",
        next => next : "next",
        sg_list => sg_list : "sg_list",
        num_sge => num_sge : "num_sge",
        opcode => opcode : "opcode",
        send_flags => send_flags : "send_flags",
        imm => imm_data_invalidated_rkey_union : "imm_data",
        imm.imm_data => imm_data_invalidated_rkey_union.imm_data : "imm_data",
        imm.invalidated_rkey => imm_data_invalidated_rkey_union.invalidated_rkey : "invalidate_rkey",
        wr => wr : "wr",
        wr.rdma => wr.rdma : "wr.rdma",
        wr.rdma.remote_addr => wr.rdma.remote_addr : "wr.rdma.remote_addr",
        wr.rdma.rkey => wr.rdma.rkey : "wr.rdma.rkey",
        wr.atomic.remote_addr => wr.atomic.remote_addr : "wr.atomic.remote_addr",
        wr.atomic.compare_add => wr.atomic.compare_add : "wr.atomic.compare_add",
        wr.atomic.swap => wr.atomic.swap : "wr.atomic.swap",
        wr.atomic.rkey => wr.atomic.rkey : "wr.atomic.rkey",
        wr.ud.ah => wr.ud.ah : "wr.ud.ah",
        wr.ud.remote_qpn => wr.ud.remote_qpn : "wr.ud.remote_qpn",
        wr.ud.remote_qkey => wr.ud.remote_qkey : "wr.ud.remote_qkey",
        qp_type => qp_type : "qp_type",
        qp_type.remote_srqn => qp_type.xrc.remote_srqn : "qp_type.xrc.remote_srqn",
        bind_mw_tso => bind_mw_tso_union : "bind_mw",
        bind_mw_tso.bind_mw.mw => bind_mw_tso_union.bind_mw.mw : "bind_mw.mw",
        bind_mw_tso.bind_mw.rkey => bind_mw_tso_union.bind_mw.rkey : "bind_mw.rkey",
        bind_mw_tso.bind_mw.bind_info => bind_mw_tso_union.bind_mw.bind_info : "bind_mw.bind_info",
        bind_mw_tso.tso.hdr => bind_mw_tso_union.tso.hdr : "tso.hdr",
        bind_mw_tso.tso.hdr_sz => bind_mw_tso_union.tso.hdr_sz : "tso.hdr_sz",
        bind_mw_tso.tso.mss => bind_mw_tso_union.tso.mss : "tso.mss",
    });
    layout!(c, sys::ibv_recv_wr, rs::ibv_recv_wr, "struct ibv_recv_wr", {
        wr_id => wr_id : "wr_id",
        next => next : "next",
        sg_list => sg_list : "sg_list",
        num_sge => num_sge : "num_sge",
    });
    layout!(c, sys::ibv_wc, rs::ibv_wc, "struct ibv_wc", {
        wr_id => wr_id : "wr_id",
        status => status : "status",
        opcode => opcode : "opcode",
        vendor_err => vendor_err : "vendor_err",
        byte_len => byte_len : "byte_len",
        imm => imm_data_invalidated_rkey_union : "imm_data",
        imm.imm_data => imm_data_invalidated_rkey_union.imm_data : "imm_data",
        imm.invalidated_rkey => imm_data_invalidated_rkey_union.invalidated_rkey : "invalidated_rkey",
        qp_num => qp_num : "qp_num",
        src_qp => src_qp : "src_qp",
        wc_flags => wc_flags : "wc_flags",
        pkey_index => pkey_index : "pkey_index",
        slid => slid : "slid",
        sl => sl : "sl",
        dlid_path_bits => dlid_path_bits : "dlid_path_bits",
    });

    constant!(c, IBV_WC_SUCCESS, Some(rs::ibv_wc_status::IBV_WC_SUCCESS));
    constant!(c, IBV_WC_RECV, Some(rs::ibv_wc_opcode::IBV_WC_RECV));
    constant!(
        c,
        IBV_WC_RECV_RDMA_WITH_IMM,
        Some(rs::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM)
    );
    constant!(
        c,
        IBV_WC_WITH_IMM,
        Some(rs::ibv_wc_flags::IBV_WC_WITH_IMM.0)
    );
    constant!(
        c,
        IBV_ACCESS_LOCAL_WRITE,
        Some(rs::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0)
    );
    constant!(
        c,
        IBV_ACCESS_REMOTE_WRITE,
        Some(rs::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0)
    );
    constant!(
        c,
        IBV_ACCESS_REMOTE_READ,
        Some(rs::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0)
    );
    constant!(
        c,
        IBV_ACCESS_MW_BIND,
        Some(rs::ibv_access_flags::IBV_ACCESS_MW_BIND.0)
    );
    constant!(c, IBV_MW_TYPE_2, Some(rs::ibv_mw_type::IBV_MW_TYPE_2));
    constant!(c, IBV_PORT_NOP, Some(rs::ibv_port_state::IBV_PORT_NOP));
    constant!(c, IBV_PORT_DOWN, Some(rs::ibv_port_state::IBV_PORT_DOWN));
    constant!(c, IBV_PORT_INIT, Some(rs::ibv_port_state::IBV_PORT_INIT));
    constant!(c, IBV_PORT_ARMED, Some(rs::ibv_port_state::IBV_PORT_ARMED));
    constant!(
        c,
        IBV_PORT_ACTIVE,
        Some(rs::ibv_port_state::IBV_PORT_ACTIVE)
    );
    constant!(
        c,
        IBV_PORT_ACTIVE_DEFER,
        Some(rs::ibv_port_state::IBV_PORT_ACTIVE_DEFER)
    );
    constant!(c, IBV_MTU_256, Some(rs::ibv_mtu::IBV_MTU_256));
    constant!(c, IBV_MTU_4096, Some(rs::ibv_mtu::IBV_MTU_4096));
    // An anonymous enum in verbs.h that rdma-sys does not bind: the C compiler only.
    constant!(c, IBV_LINK_LAYER_UNSPECIFIED, None::<u64>);
    constant!(c, IBV_LINK_LAYER_INFINIBAND, None::<u64>);
    constant!(c, IBV_LINK_LAYER_ETHERNET, None::<u64>);
    constant!(c, IBV_QPT_RC, Some(rs::ibv_qp_type::IBV_QPT_RC));
    constant!(c, IBV_QPS_RESET, Some(rs::ibv_qp_state::IBV_QPS_RESET));
    constant!(c, IBV_QPS_INIT, Some(rs::ibv_qp_state::IBV_QPS_INIT));
    constant!(c, IBV_QPS_RTR, Some(rs::ibv_qp_state::IBV_QPS_RTR));
    constant!(c, IBV_QPS_RTS, Some(rs::ibv_qp_state::IBV_QPS_RTS));
    constant!(c, IBV_QPS_ERR, Some(rs::ibv_qp_state::IBV_QPS_ERR));
    constant!(c, IBV_QP_STATE, Some(rs::ibv_qp_attr_mask::IBV_QP_STATE.0));
    constant!(
        c,
        IBV_QP_ACCESS_FLAGS,
        Some(rs::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0)
    );
    constant!(
        c,
        IBV_QP_PKEY_INDEX,
        Some(rs::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0)
    );
    constant!(c, IBV_QP_PORT, Some(rs::ibv_qp_attr_mask::IBV_QP_PORT.0));
    constant!(c, IBV_QP_AV, Some(rs::ibv_qp_attr_mask::IBV_QP_AV.0));
    constant!(
        c,
        IBV_QP_PATH_MTU,
        Some(rs::ibv_qp_attr_mask::IBV_QP_PATH_MTU.0)
    );
    constant!(
        c,
        IBV_QP_TIMEOUT,
        Some(rs::ibv_qp_attr_mask::IBV_QP_TIMEOUT.0)
    );
    constant!(
        c,
        IBV_QP_RETRY_CNT,
        Some(rs::ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0)
    );
    constant!(
        c,
        IBV_QP_RNR_RETRY,
        Some(rs::ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0)
    );
    constant!(
        c,
        IBV_QP_RQ_PSN,
        Some(rs::ibv_qp_attr_mask::IBV_QP_RQ_PSN.0)
    );
    constant!(
        c,
        IBV_QP_MAX_QP_RD_ATOMIC,
        Some(rs::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0)
    );
    constant!(
        c,
        IBV_QP_MIN_RNR_TIMER,
        Some(rs::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0)
    );
    constant!(
        c,
        IBV_QP_SQ_PSN,
        Some(rs::ibv_qp_attr_mask::IBV_QP_SQ_PSN.0)
    );
    constant!(
        c,
        IBV_QP_MAX_DEST_RD_ATOMIC,
        Some(rs::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0)
    );
    constant!(
        c,
        IBV_QP_DEST_QPN,
        Some(rs::ibv_qp_attr_mask::IBV_QP_DEST_QPN.0)
    );
    constant!(
        c,
        IBV_WR_RDMA_WRITE,
        Some(rs::ibv_wr_opcode::IBV_WR_RDMA_WRITE)
    );
    constant!(
        c,
        IBV_WR_RDMA_WRITE_WITH_IMM,
        Some(rs::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM)
    );
    constant!(
        c,
        IBV_WR_SEND_WITH_IMM,
        Some(rs::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM)
    );
    constant!(
        c,
        IBV_WR_RDMA_READ,
        Some(rs::ibv_wr_opcode::IBV_WR_RDMA_READ)
    );
    constant!(c, IBV_WR_BIND_MW, Some(rs::ibv_wr_opcode::IBV_WR_BIND_MW));
    constant!(
        c,
        IBV_SEND_SIGNALED,
        Some(rs::ibv_send_flags::IBV_SEND_SIGNALED.0)
    );
    c
}

/// Builds and runs a C program that prints each item's C expression, one value a line.
fn c_values(items: &[Item]) -> Vec<u64> {
    let dir = std::env::temp_dir().join(format!("phalanx-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut src = String::from(
        "#include <infiniband/verbs.h>\n#include <stddef.h>\n#include <stdio.h>\n\
         int main(void) {\n",
    );
    for it in items {
        src += &format!("    printf(\"%lld\\n\", (long long)({}));\n", it.c_expr);
    }
    src += "    return 0;\n}\n";
    let c = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&c, src).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::process::Command::new(&cc)
        .args(["-std=gnu11", "-o"])
        .arg(&exe)
        .arg(&c)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc}: {e}"));
    assert!(
        out.status.success(),
        "{cc} failed (is libibverbs-dev installed?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = std::process::Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse::<i64>().unwrap() as u64)
        .collect()
}

#[test]
fn hand_declared_verbs_abi_matches_rdma_sys_and_the_c_headers() {
    let c = checks();
    let from_c = c_values(&c.items);
    assert_eq!(from_c.len(), c.items.len());
    let mut bad = Vec::new();
    let (mut vs_rdma_sys, mut vs_c) = (0, 0);
    for (it, &cv) in c.items.iter().zip(&from_c) {
        if let Some(t) = it.theirs {
            vs_rdma_sys += 1;
            if t != it.ours {
                bad.push(format!("{}: ours {} rdma-sys {}", it.name, it.ours, t));
            }
        }
        vs_c += 1;
        if cv != it.ours {
            bad.push(format!(
                "{}: ours {} C {} ({})",
                it.name, it.ours, cv, it.c_expr
            ));
        }
    }
    let structs = c
        .items
        .iter()
        .filter(|i| i.name.starts_with("size_of"))
        .count();
    let fields = c
        .items
        .iter()
        .filter(|i| i.name.starts_with("offset_of"))
        .count();
    let consts = c
        .items
        .iter()
        .filter(|i| i.name.starts_with("const"))
        .count();
    println!(
        "layout check: {} items ({structs} structures: size and alignment, {fields} field \
         offsets, {consts} constants); {vs_rdma_sys} compared with rdma-sys, {vs_c} with the C \
         compiler; {} mismatches",
        c.items.len(),
        bad.len()
    );
    assert!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
}
