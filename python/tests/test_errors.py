"""Every kind of failure is a Python exception of its own class."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import phalanx


def test_classes_form_one_hierarchy():
    for cls in (phalanx.NotFound, phalanx.ObjectLost, phalanx.Timeout, phalanx.PeerDown, phalanx.OutOfMemory,
                phalanx.AlreadyExists, phalanx.InvalidArgument, phalanx.NodeShutdown,
                phalanx.ConfigError, phalanx.ProtocolError, phalanx.TransportError,
                phalanx.CoordinatorFailed):
        assert issubclass(cls, phalanx.PhalanxError)
    assert issubclass(phalanx.PhalanxError, Exception)


def test_timeout(cluster):
    t = time.monotonic()
    with pytest.raises(phalanx.Timeout):
        cluster[1].get("errors/never", timeout=0.3)
    assert time.monotonic() - t < 5


def test_huge_and_zero_timeouts(cluster):
    cluster[0].put("errors/huge", b"h" * 100)
    assert bytes(cluster[1].get("errors/huge", timeout=1e300)) == b"h" * 100
    assert bytes(cluster[1].get("errors/huge", timeout=1e15)) == b"h" * 100
    with pytest.raises(phalanx.Timeout):
        cluster[1].get("errors/absent", timeout=0)
    with pytest.raises(phalanx.InvalidArgument):
        cluster[1].get("errors/huge", timeout=float("nan"))


def test_not_found_after_delete(cluster):
    cluster[0].put("errors/deleted", np.zeros(200_000, np.uint8))
    cluster[0].delete("errors/deleted")
    with pytest.raises(phalanx.NotFound):
        cluster[0].get_into("errors/deleted", bytearray(200_000), timeout=5)


def test_already_exists(cluster):
    cluster[2].put("errors/twice", b"1")
    with pytest.raises(phalanx.AlreadyExists):
        cluster[2].put("errors/twice", b"2")


def test_invalid_arguments(cluster):
    cluster[0].put("errors/in", np.ones(4, np.float32))
    with pytest.raises(phalanx.InvalidArgument):
        cluster[0].reduce("errors/out", ["errors/in"], op="median")
    with pytest.raises(phalanx.InvalidArgument):
        cluster[0].reduce("errors/out", ["errors/in"], dtype="complex64")
    with pytest.raises(phalanx.InvalidArgument):
        cluster[0].reduce("errors/out", ["errors/in"], dtype=np.float16)
    with pytest.raises(phalanx.InvalidArgument):
        cluster[0].get("errors/in", timeout=-1)
    with pytest.raises(phalanx.InvalidArgument):
        cluster[0].allreduce("errors/out", ["errors/in"], coordinator=99)


def test_out_of_memory():
    with phalanx.local_cluster(1, arena_size=1 << 20) as c:
        with pytest.raises(phalanx.OutOfMemory):
            c[0].put("big", np.zeros(2 << 20, np.uint8))


def test_a_dead_input_holder_makes_a_reduce_wait_for_its_rejoin_then_time_out():
    with phalanx.local_cluster(3, op_timeout=10.0) as c:
        # The reduce needs an input held only by node 2, which dies first: Phalanx waits for
        # the node to rejoin and put it again, so the caller sees its own timeout.
        c[1].put("pd/a", np.ones(1 << 18, np.float32))
        c[2].put("pd/b", np.ones(1 << 18, np.float32))
        c[2].kill()
        t = time.monotonic()
        with pytest.raises(phalanx.Timeout):
            c[0].reduce("pd/sum", ["pd/a", "pd/b"], n=2, timeout=1.5)
        assert time.monotonic() - t < 8
        with pytest.raises(phalanx.NodeShutdown):
            c[2].get("pd/a", timeout=5)
        c[1].shutdown()
        assert c[1].closed
        with pytest.raises(phalanx.NodeShutdown):
            c[1].put("pd/after", b"x")


def test_an_object_whose_every_copy_died_is_lost():
    with phalanx.local_cluster(3, op_timeout=30.0, lost_after=0.5) as c:
        # Its directory entry on node 0 ("@0/..."), which lives on.
        c[2].put("@0/lost/a", np.arange(1 << 16, dtype=np.float32))
        c[2].kill()
        t = time.monotonic()
        with pytest.raises(phalanx.ObjectLost):
            c[0].get("@0/lost/a")
        assert time.monotonic() - t < 10
        # Put again, it is read as any object.
        c[1].put("@0/lost/a", np.ones(4, np.float32))
        assert np.array_equal(np.frombuffer(c[0].get("@0/lost/a"), np.float32), np.ones(4))


def test_a_target_whose_coordinator_died_before_making_it_is_lost():
    with phalanx.local_cluster(3, op_timeout=30.0, lost_after=0.5) as c:
        # Node 2 coordinates a reduce that waits for an input never put; the target's entry
        # lives on node 0 ("@0/..."), which hears the coordinator's promise to make it.
        c[1].put("@0/fate/a", np.ones(1 << 10, np.float32))
        c[2].reduce_start("@0/fate/sum", ["@0/fate/a", "@0/fate/b"], n=2, dtype="float32")
        time.sleep(0.2)
        c[2].kill()
        t = time.monotonic()
        with pytest.raises(phalanx.ObjectLost):
            c[0].get("@0/fate/sum")
        assert time.monotonic() - t < 10


@pytest.mark.parametrize("kind,cls", [
    ("NotFound", phalanx.NotFound), ("ObjectLost", phalanx.ObjectLost),
    ("AlreadyExists", phalanx.AlreadyExists),
    ("OutOfMemory", phalanx.OutOfMemory), ("Timeout", phalanx.Timeout),
    ("PeerDown", phalanx.PeerDown), ("Protocol", phalanx.ProtocolError),
    ("InvalidArgument", phalanx.InvalidArgument), ("Shutdown", phalanx.NodeShutdown),
    ("CoordinatorFailed", phalanx.CoordinatorFailed),
    ("Config", phalanx.ConfigError), ("Transport", phalanx.TransportError),
    ("TransportPeerFailed", phalanx.PeerDown), ("TransportShutdown", phalanx.NodeShutdown),
])
def test_every_error_kind_has_its_class(kind, cls):
    from phalanx import _native
    with pytest.raises(cls) as e:
        _native._raise_error(kind)
    assert type(e.value) is cls
    assert str(e.value)


def test_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("transport = \"carrier-pigeon\"\n")
    with pytest.raises(phalanx.ConfigError):
        phalanx.Node(str(bad), 0)
    with pytest.raises(phalanx.ConfigError):
        phalanx.Node(str(tmp_path / "missing.toml"), 0)


def test_ctrl_c_interrupts_a_blocking_get():
    code = textwrap.dedent("""
        import sys, time, phalanx
        c = phalanx.local_cluster(2)
        print("ready", flush=True)
        t = time.monotonic()
        try:
            c[1].get("never-put")
        except KeyboardInterrupt:
            print(f"interrupted {time.monotonic() - t:.3f}", flush=True)
            sys.exit(0)
        sys.exit(3)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    assert out.startswith("interrupted")
