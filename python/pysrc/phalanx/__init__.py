"""Phalanx: a collective-communication object store for task-based distributed systems.

Tasks on many hosts ``put`` immutable objects and ``get`` them by name; a node can ``reduce``
a set of objects (the first ``n`` of them to become ready) into a new one. Broadcasts form
trees on their own, bytes are forwarded while they arrive, and a collective survives the
death of a participant.

One node per process::

    import numpy as np, phalanx
    node = phalanx.Node("cluster.toml", id=0)     # or phalanx.init() under a launcher
    node.put("weights", np.ones(1 << 20, np.float32))
    view = node.get("weights")                    # read-only memoryview, zero-copy
    w = np.frombuffer(view, dtype=np.float32)

Several nodes in one process (tests, notebooks)::

    with phalanx.local_cluster(4) as c:
        c[0].put("x", b"hello")
        assert bytes(c[3].get("x")) == b"hello"

Blocking calls release the GIL and honour Ctrl-C. Errors are subclasses of
``phalanx.PhalanxError``: ``NotFound``, ``ObjectLost``, ``Timeout``, ``PeerDown``,
``OutOfMemory``, ...
"""

from __future__ import annotations

import os
from typing import Optional

from ._native import (
    INLINE_LIMIT,
    AlreadyExists,
    Claims,
    ConfigError,
    CoordinatorFailed,
    InvalidArgument,
    LocalCluster,
    Node,
    NodeShutdown,
    NotFound,
    ObjectBuffer,
    ObjectLost,
    ObjectWriter,
    OutOfMemory,
    PeerDown,
    PhalanxError,
    ProtocolError,
    ReduceHandle,
    ReduceResult,
    Timeout,
    TransportError,
    local_cluster,
)

__all__ = [
    "INLINE_LIMIT",
    "AlreadyExists",
    "Claims",
    "ConfigError",
    "CoordinatorFailed",
    "InvalidArgument",
    "LocalCluster",
    "Node",
    "NodeShutdown",
    "NotFound",
    "ObjectBuffer",
    "ObjectLost",
    "ObjectWriter",
    "OutOfMemory",
    "PeerDown",
    "PhalanxError",
    "ProtocolError",
    "ReduceHandle",
    "ReduceResult",
    "Timeout",
    "TransportError",
    "init",
    "local_cluster",
    "rank",
]


def rank() -> int:
    """This process's rank under a launcher: ``PHALANX_RANK``, else ``SLURM_PROCID``."""
    for var in ("PHALANX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{var}={value!r} is not a rank") from None
    raise ConfigError("no rank: set PHALANX_RANK (python -m phalanx launch does) or SLURM_PROCID")


def init(config: Optional[str] = None, timeout: Optional[float] = None) -> Node:
    """Starts this process's node of a launched cluster.

    ``config`` defaults to ``PHALANX_CONFIG`` (set by ``python -m phalanx launch``); the
    node id is :func:`rank`. Waits for the other nodes (at most ``timeout`` seconds).
    """
    path = config or os.environ.get("PHALANX_CONFIG")
    if not path:
        raise ConfigError("no cluster config: pass one or set PHALANX_CONFIG")
    return Node(path, rank(), timeout=timeout)
