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
    ObjectLost,
    PhalanxError,
    "Every copy of the object was on nodes that died; it exists again once put again."
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
    CoordinatorFailed,
    PhalanxError,
    "A collective this node reads failed at its coordinator (bad inputs, a timeout)."
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
    use phalanx::transport::TransportError as T;
    use phalanx::Error as E;
    let msg = e.to_string();
    match e {
        E::NotFound(_) => NotFound::new_err(msg),
        E::ObjectLost(_) => ObjectLost::new_err(msg),
        E::AlreadyExists(_) => AlreadyExists::new_err(msg),
        E::OutOfMemory { .. } => OutOfMemory::new_err(msg),
        E::Timeout(..) => Timeout::new_err(msg),
        E::PeerDown(_) => PeerDown::new_err(msg),
        E::Protocol { .. } => ProtocolError::new_err(msg),
        E::InvalidArgument(_) => InvalidArgument::new_err(msg),
        E::CoordinatorFailed(..) => CoordinatorFailed::new_err(msg),
        E::Shutdown => NodeShutdown::new_err(msg),
        E::Config(_) => ConfigError::new_err(msg),
        // A link that is gone is a peer that is down; a closed transport, a closed node.
        E::Transport(T::PeerUnavailable(_) | T::PeerFailed { .. }) => PeerDown::new_err(msg),
        E::Transport(T::Shutdown) => NodeShutdown::new_err(msg),
        E::Transport(_) => TransportError::new_err(msg),
    }
}

/// Raises the exception `to_py` makes of a `phalanx::Error` of the given kind (the test of
/// the mapping: not every kind can be provoked from Python on one machine).
#[pyfunction]
pub fn _raise_error(kind: &str) -> PyResult<()> {
    use phalanx::Error as E;
    let id = || phalanx::ObjectId::new("x");
    let e = match kind {
        "NotFound" => E::NotFound(id()),
        "ObjectLost" => E::ObjectLost(id()),
        "AlreadyExists" => E::AlreadyExists(id()),
        "OutOfMemory" => E::OutOfMemory {
            requested: 2,
            free: 1,
            capacity: 1,
        },
        "Timeout" => E::Timeout(std::time::Duration::from_secs(1), "x".into()),
        "PeerDown" => E::PeerDown(3),
        "Protocol" => E::Protocol {
            peer: 3,
            what: "x".into(),
        },
        "InvalidArgument" => E::InvalidArgument("x".into()),
        "CoordinatorFailed" => E::CoordinatorFailed(id(), "x".into()),
        "Shutdown" => E::Shutdown,
        "Config" => E::Config("x".into()),
        "Transport" => E::Transport(phalanx::transport::TransportError::NoArena),
        "TransportPeerFailed" => E::Transport(phalanx::transport::TransportError::PeerFailed {
            peer: 3,
            reason: "reset".into(),
        }),
        "TransportShutdown" => E::Transport(phalanx::transport::TransportError::Shutdown),
        _ => return Err(pyo3::exceptions::PyValueError::new_err(kind.to_owned())),
    };
    Err(to_py(e))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_raise_error, m)?)?;
    let py = m.py();
    m.add("PhalanxError", py.get_type::<PhalanxError>())?;
    m.add("NotFound", py.get_type::<NotFound>())?;
    m.add("ObjectLost", py.get_type::<ObjectLost>())?;
    m.add("AlreadyExists", py.get_type::<AlreadyExists>())?;
    m.add("OutOfMemory", py.get_type::<OutOfMemory>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("PeerDown", py.get_type::<PeerDown>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("CoordinatorFailed", py.get_type::<CoordinatorFailed>())?;
    m.add("NodeShutdown", py.get_type::<NodeShutdown>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    Ok(())
}
