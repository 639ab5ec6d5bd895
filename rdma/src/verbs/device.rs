//! Device list, device context, port and GID queries.

use super::VerbsError;
use rdma_sys::*;
use std::ffi::CStr;
use std::sync::Arc;

/// `port_attr.link_layer` values (macros in verbs.h, absent from the bindings).
pub const LINK_LAYER_INFINIBAND: u8 = 1;
pub const LINK_LAYER_ETHERNET: u8 = 2;

/// RAII owner of the array returned by `ibv_get_device_list`.
struct DeviceList {
    list: *mut *mut ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, VerbsError> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is owned by us until freed.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            // No verbs devices or no kernel support at all (ENOSYS): both mean "none".
            return Ok(DeviceList { list, len: 0 });
        }
        Ok(DeviceList {
            list,
            len: n.max(0) as usize,
        })
    }

    fn devices(&self) -> impl Iterator<Item = (*mut ibv_device, String)> + '_ {
        (0..self.len).map(move |i| {
            // SAFETY: i < len entries, all non-null while the list is alive.
            let dev = unsafe { *self.list.add(i) };
            // SAFETY: the device pointer is valid; the name is a NUL-terminated C string.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
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
            unsafe { ibv_free_device_list(self.list) };
        }
    }
}

/// Names of the RDMA devices on this host (empty when there are none).
pub fn device_names() -> Vec<String> {
    match DeviceList::get() {
        Ok(l) => l.devices().map(|(_, n)| n).collect(),
        Err(_) => Vec::new(),
    }
}

/// An open device (`ibv_context`).
pub struct Context {
    pub(crate) ctx: *mut ibv_context,
    name: String,
    max_cqe: i32,
    max_qp_wr: i32,
}

// SAFETY: an ibv_context may be used from any thread; libibverbs serialises internally.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes &self and calls thread-safe verbs.
unsafe impl Sync for Context {}

/// What we use of `ibv_port_attr`.
#[derive(Debug, Clone, Copy)]
pub struct PortInfo {
    pub active: bool,
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
        let ctx = unsafe { ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(VerbsError::errno("ibv_open_device"));
        }
        // SAFETY: ibv_device_attr is plain old data; zero is a valid bit pattern.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open; attr is a valid out-pointer.
        let rc = unsafe { ibv_query_device(ctx, &mut attr) };
        let c = Context {
            ctx,
            name: dev_name,
            max_cqe: attr.max_cqe,
            max_qp_wr: attr.max_qp_wr,
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

    pub fn query_port(&self, port: u8) -> Result<PortInfo, VerbsError> {
        // SAFETY: ibv_port_attr is plain old data; zero is a valid bit pattern.
        let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `a` is a valid, correctly sized out-pointer.
        let rc = unsafe { ___ibv_query_port(self.ctx, port, &mut a) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_query_port", rc));
        }
        Ok(PortInfo {
            active: a.state == ibv_port_state::IBV_PORT_ACTIVE,
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
        let rc = unsafe { ibv_query_gid(self.ctx, port, index, &mut g) };
        if rc != 0 {
            return Err(VerbsError::code("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok(unsafe { g.raw })
    }

    /// The GID type string the kernel publishes ("RoCE v2", "IB/RoCE v1"), if readable.
    fn gid_type(&self, port: u8, index: i32) -> Option<String> {
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
        unsafe { ibv_close_device(self.ctx) };
    }
}
