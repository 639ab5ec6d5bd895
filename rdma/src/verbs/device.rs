//! Device list, device context, port and GID queries.

use super::sys::{self, ibv_context, ibv_device, ibv_device_attr, ibv_gid, ibv_port_attr, Lib};
use super::VerbsError;
use std::ffi::CStr;
use std::sync::Arc;

/// `port_attr.link_layer` values.
pub const LINK_LAYER_INFINIBAND: u8 = sys::IBV_LINK_LAYER_INFINIBAND;
pub const LINK_LAYER_ETHERNET: u8 = sys::IBV_LINK_LAYER_ETHERNET;

/// RAII owner of the array returned by `ibv_get_device_list`.
struct DeviceList {
    lib: &'static Lib,
    list: *mut *mut ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, VerbsError> {
        let lib = sys::lib()?;
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is owned by us until freed.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            // No verbs devices or no kernel support at all (ENOSYS): both mean "none".
            return Ok(DeviceList { lib, list, len: 0 });
        }
        Ok(DeviceList {
            lib,
            list,
            len: n.max(0) as usize,
        })
    }

    fn devices(&self) -> impl Iterator<Item = (*mut ibv_device, String)> + '_ {
        (0..self.len).map(move |i| {
            // SAFETY: i < len entries, all non-null while the list is alive.
            let dev = unsafe { *self.list.add(i) };
            // SAFETY: the device pointer is valid; the name is a NUL-terminated C string.
            let name = unsafe { CStr::from_ptr((self.lib.get_device_name)(dev)) }
                .to_string_lossy()
                .into_owned();
            (dev, name)
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: the list came from ibv_get_device_list and is freed once; opened
            // contexts stay valid after the list is freed (documented by libibverbs).
            unsafe { (self.lib.free_device_list)(self.list) };
        }
    }
}

/// Names of the RDMA devices on this host (empty when there are none, or when libibverbs
/// is not installed).
pub fn device_names() -> Vec<String> {
    list_devices().unwrap_or_default()
}

/// Names of the RDMA devices on this host; an error when libibverbs cannot be loaded.
pub fn list_devices() -> Result<Vec<String>, VerbsError> {
    Ok(DeviceList::get()?.devices().map(|(_, n)| n).collect())
}

/// An open device (`ibv_context`).
pub struct Context {
    pub(crate) ctx: *mut ibv_context,
    pub(crate) lib: &'static Lib,
    name: String,
    max_cqe: i32,
    max_qp_wr: i32,
    phys_port_cnt: u8,
}

// SAFETY: an ibv_context may be used from any thread; libibverbs serialises internally.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes &self and calls thread-safe verbs.
unsafe impl Sync for Context {}

/// What we use of `ibv_port_attr`.
#[derive(Debug, Clone, Copy)]
pub struct PortInfo {
    pub active: bool,
    /// `ibv_port_state` (4 = ACTIVE).
    pub state: u32,
    pub lid: u16,
    pub active_mtu: u32,
    pub link_layer: u8,
    pub gid_tbl_len: i32,
}

/// A selected GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidInfo {
    pub index: u8,
    pub gid: [u8; 16],
}

impl Context {
    /// Opens the device called `name`, or the first device with `None`.
    pub fn open(name: Option<&str>) -> Result<Arc<Context>, VerbsError> {
        let list = DeviceList::get()?;
        let (dev, dev_name) = match name {
            Some(want) => list
                .devices()
                .find(|(_, n)| n == want)
                .ok_or_else(|| VerbsError::DeviceNotFound(want.to_string()))?,
            None => list.devices().next().ok_or(VerbsError::NoDevice)?,
        };
        // SAFETY: `dev` is an entry of the live device list.
        let ctx = unsafe { (list.lib.open_device)(dev) };
        if ctx.is_null() {
            return Err(VerbsError::errno("ibv_open_device"));
        }
        // SAFETY: ibv_device_attr is plain old data; zero is a valid bit pattern.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open; attr is a valid out-pointer.
        let rc = unsafe { (list.lib.query_device)(ctx, &mut attr) };
        let c = Context {
            ctx,
            lib: list.lib,
            name: dev_name,
            max_cqe: attr.max_cqe,
            max_qp_wr: attr.max_qp_wr,
            phys_port_cnt: attr.phys_port_cnt,
        };
        if rc != 0 {
            return Err(VerbsError::code("ibv_query_device", rc));
        }
        Ok(Arc::new(c))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn max_cqe(&self) -> i32 {
        self.max_cqe
    }

    pub fn max_qp_wr(&self) -> i32 {
        self.max_qp_wr
    }

    /// Number of ports (numbered 1..=n).
    pub fn port_count(&self) -> u8 {
        self.phys_port_cnt
    }

    pub fn query_port(&self, port: u8) -> Result<PortInfo, VerbsError> {
        // SAFETY: ibv_port_attr is plain old data; zero is a valid bit pattern.
        let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `a` is a valid, correctly sized out-pointer.
        // Like verbs.h's inline ibv_query_port, the exported function gets a full, zeroed
        // ibv_port_attr (the provider fills in at most that much).
        let rc = unsafe { (self.lib.query_port)(self.ctx, port, &mut a) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_query_port", rc));
        }
        Ok(PortInfo {
            active: a.state == sys::IBV_PORT_ACTIVE,
            state: a.state,
            lid: a.lid,
            active_mtu: a.active_mtu,
            link_layer: a.link_layer,
            gid_tbl_len: a.gid_tbl_len,
        })
    }

    pub fn query_gid(&self, port: u8, index: i32) -> Result<[u8; 16], VerbsError> {
        // SAFETY: ibv_gid is a 16-byte union of plain data.
        let mut g: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `g` is a valid out-pointer.
        let rc = unsafe { (self.lib.query_gid)(self.ctx, port, index, &mut g) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok(unsafe { g.raw })
    }

    /// The GID type string the kernel publishes ("RoCE v2", "IB/RoCE v1"), if readable.
    pub fn gid_type(&self, port: u8, index: i32) -> Option<String> {
        let p = format!(
            "/sys/class/infiniband/{}/ports/{}/gid_attrs/types/{}",
            self.name, port, index
        );
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    }

    /// Picks the GID to use on `port`: `index` if given; otherwise an IPv4-mapped GID
    /// (`::ffff:a.b.c.d`), RoCE v2 preferred; otherwise index 0 (InfiniBand).
    pub fn select_gid(&self, port: u8, index: Option<u8>) -> Result<GidInfo, VerbsError> {
        if let Some(i) = index {
            return Ok(GidInfo {
                index: i,
                gid: self.query_gid(port, i as i32)?,
            });
        }
        let info = self.query_port(port)?;
        let mut first_v4: Option<GidInfo> = None;
        for i in 0..info.gid_tbl_len.min(256) {
            let Ok(gid) = self.query_gid(port, i) else {
                continue;
            };
            let v4_mapped = gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff;
            if !v4_mapped {
                continue;
            }
            let g = GidInfo {
                index: i as u8,
                gid,
            };
            if self.gid_type(port, i).is_some_and(|t| t.contains("v2")) {
                return Ok(g);
            }
            first_v4.get_or_insert(g);
        }
        if let Some(g) = first_v4 {
            return Ok(g);
        }
        if info.link_layer == LINK_LAYER_ETHERNET {
            return Err(VerbsError::Invalid(format!(
                "{} port {port}: no IPv4-mapped GID (is an IP address configured on the netdev?)",
                self.name
            )));
        }
        Ok(GidInfo {
            index: 0,
            gid: self.query_gid(port, 0)?,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc<Context>, so none is alive any more.
        unsafe { (self.lib.close_device)(self.ctx) };
    }
}
