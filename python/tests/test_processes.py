"""Nodes in other processes: `python -m phalanx node`, and what importing loads."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import phalanx
from phalanx.launch import write_local_config


def test_import_and_a_tcp_cluster_load_no_verbs_library():
    with phalanx.local_cluster(2) as c:
        c[0].put("maps/x", b"x")
        assert bytes(c[1].get("maps/x", timeout=10)) == b"x"
        with open("/proc/self/maps") as f:
            maps = f.read()
    assert "libibverbs" not in maps and "librdmacm" not in maps


def test_nodes_run_by_python_m_phalanx_node_serve_this_process(tmp_path):
    config = write_local_config(3, str(tmp_path / "cluster.toml"))
    procs = [
        subprocess.Popen([sys.executable, "-m", "phalanx", "node", "--config", config, "--id", str(k), "--secs", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for k in (1, 2)
    ]
    try:
        with phalanx.Node(config, 0, timeout=30) as node:
            assert node.num_nodes == 3 and node.is_alive(1) and node.is_alive(2)
            # Homed on node 1: its directory entry lives in that process.
            node.put("@1/remote", np.arange(1000, dtype=np.int64))
            assert np.array_equal(np.frombuffer(node.get("@1/remote", timeout=10), np.int64), np.arange(1000))
            # A large object whose entry lives on node 2: put, deleted, gone.
            big = np.random.default_rng(3).integers(0, 255, 3 << 20, dtype=np.uint8)
            node.put("@2/big", big)
            node.delete("@2/big")
            with pytest.raises(phalanx.PhalanxError):
                node.get("@2/big", timeout=1)
            for p in procs:
                p.terminate()
            deadline = time.monotonic() + 20
            while (node.is_alive(1) or node.is_alive(2)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not node.is_alive(1) and not node.is_alive(2)
        for p in procs:
            out, _ = p.communicate(timeout=20)
            assert p.returncode == 0, out
            assert "up (tcp)" in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
