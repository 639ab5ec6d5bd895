//! One Python exception class per kind of `phalanx::Error`, all under `phalanx.PhalanxError`.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    phalanx,
    PhalanxError,
    PyException,
    "Base class of every Phalanx error."
);
create_exception!(
    phalanx,
    NotFound,
    PhalanxError,
    "The object does not exist (or was deleted)."
);
create_exception!(
    phalanx,
    AlreadyExists,
    PhalanxError,
    "An object of that name is already on this node."
);
create_exception!(
    phalanx,
    OutOfMemory,
    PhalanxError,
    "The object does not fit in the node's arena."
);
create_exception!(
    phalanx,
    Timeout,
    PhalanxError,
    "The call did not complete within its timeout."
);
create_exception!(
    phalanx,
    PeerDown,
    PhalanxError,
    "A node the call depended on is down."
);
create_exception!(
    phalanx,
    ProtocolError,
    PhalanxError,
    "A peer sent something malformed."
);
create_exception!(
    phalanx,
    InvalidArgument,
    PhalanxError,
    "An argument was rejected."
);
create_exception!(
    phalanx,
    NodeShutdown,
    PhalanxError,
    "The node is shut down."
);
create_exception!(
    phalanx,
    ConfigError,
    PhalanxError,
    "The configuration is invalid."
);
create_exception!(
    phalanx,
    TransportError,
    PhalanxError,
    "The transport failed (socket or verbs)."
);

/// The Python exception for a Phalanx error, carrying its message.
pub fn to_py(e: phalanx::Error) -> PyErr {
    use phalanx::Error as E;
    let msg = e.to_string();
    match e {
        E::NotFound(_) => NotFound::new_err(msg),
        E::AlreadyExists(_) => AlreadyExists::new_err(msg),
        E::OutOfMemory { .. } => OutOfMemory::new_err(msg),
        E::Timeout(..) => Timeout::new_err(msg),
        E::PeerDown(_) => PeerDown::new_err(msg),
        E::Protocol { .. } => ProtocolError::new_err(msg),
        E::InvalidArgument(_) => InvalidArgument::new_err(msg),
        E::Shutdown => NodeShutdown::new_err(msg),
        E::Config(_) => ConfigError::new_err(msg),
        E::Transport(_) => TransportError::new_err(msg),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PhalanxError", py.get_type::<PhalanxError>())?;
    m.add("NotFound", py.get_type::<NotFound>())?;
    m.add("AlreadyExists", py.get_type::<AlreadyExists>())?;
    m.add("OutOfMemory", py.get_type::<OutOfMemory>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("PeerDown", py.get_type::<PeerDown>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("NodeShutdown", py.get_type::<NodeShutdown>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    Ok(())
}
