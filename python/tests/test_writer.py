"""Objects written in place (Node.create): a NumPy array over the arena, sealed, read elsewhere."""

import threading

import numpy as np
import pytest

import phalanx


def test_an_array_filled_in_the_arena_is_read_identical_on_another_node(cluster):
    n = (4 << 20) + 3  # float32 elements: 16 MiB and 12 bytes
    want = np.arange(n, dtype=np.float32) * 0.5
    w = cluster[0].create("writer/arange", want.nbytes)
    assert not w.closed and w.written == 0 and len(w) == want.nbytes
    a = np.frombuffer(w, dtype=np.float32)
    assert a.flags.writeable and a.shape == (n,)
    # The array is the arena copy itself: filling it is the only copy.
    base, length = cluster[0].arena_range()
    assert base <= a.ctypes.data and a.ctypes.data + a.nbytes <= base + length
    np.multiply(np.arange(n, dtype=np.float32), 0.5, out=a)
    del a
    w.seal()
    assert w.sealed and w.written == want.nbytes
    got = np.frombuffer(cluster[1].get("writer/arange", timeout=20), dtype=np.float32)
    assert np.array_equal(got, want)
    here = np.frombuffer(cluster[0].get("writer/arange"), dtype=np.float32)
    assert np.array_equal(here, want)
    cluster[0].delete("writer/arange")


@pytest.mark.parametrize("size", [0, 1000, 64 * 1024])
def test_small_and_empty_objects_are_written_in_place_too(cluster, size):
    want = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
    name = f"writer/small/{size}"
    with cluster[0].create(name, size) as w:
        np.frombuffer(w, dtype=np.uint8)[:] = want
    assert w.sealed
    got = np.frombuffer(cluster[2].get(name, timeout=20), dtype=np.uint8)
    assert np.array_equal(got, want)
    cluster[0].delete(name)


def test_a_writer_with_a_live_view_refuses_to_move_on(cluster):
    w = cluster[0].create("writer/held", 1 << 20)
    a = np.frombuffer(w, dtype=np.uint8)
    a[:] = 7
    for step in (w.seal, w.abort, lambda: w.commit(10), lambda: w.write(b"x")):
        with pytest.raises(BufferError):
            step()
    assert not w.closed
    del a  # the array's export is released with it
    w.seal()
    assert bytes(cluster[1].get("writer/held", timeout=20)[:3]) == b"\x07\x07\x07"
    # Sealed: nothing more to write.
    with pytest.raises(BufferError):
        memoryview(w)
    with pytest.raises(phalanx.InvalidArgument):
        w.write(b"more")
    cluster[0].delete("writer/held")


def test_an_announced_object_streams_as_it_is_committed(cluster):
    n = 1 << 20  # float64 elements: 8 MiB
    want = np.linspace(0.0, 1.0, n)
    w = cluster[0].create("writer/streamed", want.nbytes)
    w.announce()
    got = {}
    reader = threading.Thread(
        target=lambda: got.setdefault("v", cluster[1].get("writer/streamed", timeout=30))
    )
    reader.start()
    half = n // 2
    with memoryview(w) as mv:
        np.frombuffer(mv, dtype=np.float64, count=half)[:] = want[:half]
    w.commit(half * 8)
    assert w.written == half * 8
    # The rest: a new view starts where the committed bytes end.
    with memoryview(w) as mv:
        assert mv.nbytes == (n - half) * 8
        np.frombuffer(mv, dtype=np.float64)[:] = want[half:]
    w.seal()
    reader.join(timeout=30)
    assert np.array_equal(np.frombuffer(got["v"], dtype=np.float64), want)
    cluster[0].delete("writer/streamed")


def test_copied_in_bytes_must_all_be_written_before_the_seal(cluster):
    w = cluster[0].create("writer/short", 100_000)
    w.write(np.ones(50_000, dtype=np.uint8))
    assert w.written == 50_000
    with pytest.raises(phalanx.InvalidArgument):
        w.seal()
    assert w.closed and not w.sealed
    # Taken back: the name is free again.
    w = cluster[0].create("writer/short", 10)
    w.write(b"0123456789")
    w.seal()
    assert bytes(cluster[1].get("writer/short", timeout=20)) == b"0123456789"
    cluster[0].delete("writer/short")


def test_an_exception_in_the_with_block_takes_the_object_back(cluster):
    with pytest.raises(RuntimeError):
        with cluster[0].create("writer/failed", 1 << 20) as w:
            w.write(b"partial")
            raise RuntimeError("the task failed")
    assert w.closed and not w.sealed
    with pytest.raises(phalanx.Timeout):
        cluster[1].get("writer/failed", timeout=0.3)
    # The name is free again; an existing one is refused.
    with cluster[0].create("writer/failed", 3) as w:
        w.write(b"abc")
    with pytest.raises(phalanx.AlreadyExists):
        cluster[0].create("writer/failed", 3)
    cluster[0].delete("writer/failed")
