"""Starting nodes: one node in this process until stopped, or a program once per node."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional


def run_node(config: str, node_id: Optional[int], rejoin: bool, secs: Optional[float]) -> int:
    """Runs one node (it serves objects, its directory shard and reduce tasks) until Ctrl-C,
    SIGTERM or ``secs``."""
    from . import Node, rank

    nid = rank() if node_id is None else node_id
    node = Node(config, nid, rejoin=rejoin)
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    print(f"phalanx node {node.id} of {node.num_nodes} up ({node.stats()['transport']})", flush=True)
    end = None if secs is None else time.monotonic() + secs
    try:
        while not stop["now"] and not node.closed and (end is None or time.monotonic() < end):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    node.shutdown()
    return 0


def _free_ports(n: int) -> List[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_local_config(n: int, path: str, base_port: int = 0, extra: str = "") -> str:
    """Writes a TCP cluster config of ``n`` nodes on 127.0.0.1 to ``path``, with a fresh
    cluster secret (README "Trust"; the file is readable by its owner only)."""
    ports = list(range(base_port, base_port + n)) if base_port else _free_ports(n)
    lines = ['transport = "tcp"', "heartbeat_ms = 10000", f'secret = "{secrets.token_hex(32)}"', extra]
    for k, port in enumerate(ports):
        lines += ["", "[[nodes]]", f"id = {k}", f'addr = "127.0.0.1:{port}"']
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _load_config(config: str) -> dict:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - older Pythons
        import tomli as tomllib  # type: ignore
    with open(config, "rb") as f:
        return tomllib.load(f)


def _config_hosts(cfg: dict) -> List[str]:
    nodes = sorted(cfg.get("nodes", []), key=lambda e: e["id"])
    return [str(e["addr"]).rsplit(":", 1)[0] for e in nodes]


def _netns_of(addr: str) -> Optional[str]:
    """The namespace owning an emulated host's address (cluster/netns.sh: 10.77.0.K+1 is
    phx-K), if that namespace exists."""
    prefix = os.environ.get("PHX_SUBNET", "10.77.0") + "."
    if not addr.startswith(prefix):
        return None
    name = f"{os.environ.get('PHX_PREFIX', 'phx')}-{int(addr[len(prefix):]) - 1}"
    return name if os.path.exists(f"/var/run/netns/{name}") else None


def launch(program: str, args: List[str], nodes: Optional[int], config: Optional[str],
           timeout: float, base_port: int = 0) -> int:
    """Runs ``program`` once per node with PHALANX_RANK and PHALANX_CONFIG set; rank 0's
    output is shown as it comes, the others' when they fail. Any failing rank, Ctrl-C or the
    timeout stops every rank. Returns the first failing rank's exit status, else 0."""
    tmp = None
    if config is None:
        if not nodes:
            raise SystemExit("launch: give -n N or --config")
        tmp = tempfile.TemporaryDirectory(prefix="phalanx-launch-")
        config = write_local_config(nodes, os.path.join(tmp.name, "cluster.toml"), base_port)
    cfg = _load_config(config)
    hosts = _config_hosts(cfg)
    base_env = dict(os.environ)
    if "secret" not in cfg and "secret_file" not in cfg and not base_env.get("PHALANX_SECRET"):
        # A config without a secret: the ranks share one made for this launch.
        base_env["PHALANX_SECRET"] = secrets.token_hex(32)
    if nodes is not None and nodes != len(hosts):
        raise SystemExit(f"launch: -n {nodes} but {config} has {len(hosts)} nodes")
    logs = tempfile.TemporaryDirectory(prefix="phalanx-logs-")
    procs = []
    try:
        for k, host in enumerate(hosts):
            env = dict(base_env, PHALANX_RANK=str(k), PHALANX_CONFIG=os.path.abspath(config))
            cmd = [sys.executable, program, *args]
            ns = _netns_of(host)
            if ns is not None:
                cmd = ["ip", "netns", "exec", ns, *cmd]
            out = None if k == 0 else open(os.path.join(logs.name, f"rank{k}.log"), "w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
        end = time.monotonic() + timeout
        status = 0
        while procs and time.monotonic() < end:
            running = False
            for k, p in enumerate(procs):
                rc = p.poll()
                if rc is None:
                    running = True
                elif rc != 0 and status == 0:
                    status = rc
                    print(f"launch: rank {k} exited with {rc}", file=sys.stderr)
                    if k != 0:
                        with open(os.path.join(logs.name, f"rank{k}.log")) as f:
                            sys.stderr.write(f.read())
            if not running or status != 0:
                break
            time.sleep(0.05)
        else:
            if procs:
                print(f"launch: timeout after {timeout} s", file=sys.stderr)
                status = 124
        return status
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        logs.cleanup()
        if tmp is not None:
            tmp.cleanup()
