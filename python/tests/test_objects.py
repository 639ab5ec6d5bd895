"""put/get/get_into/delete of NumPy arrays and other buffers across nodes."""

import threading
import time

import numpy as np
import pytest

import phalanx

SIZES = [0, 1, 1000, 64 * 1024 - 1, 64 * 1024, (1 << 20) + 3, 64 << 20]


def pattern(size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=size, dtype=np.uint8)


@pytest.mark.parametrize("size", SIZES)
def test_put_get_is_byte_identical_across_nodes(cluster, size):
    a = pattern(size, size)
    name = f"objects/{size}"
    cluster[0].put(name, a)
    for k in (1, 2):
        view = cluster[k].get(name, timeout=20)
        assert view.readonly
        assert view.nbytes == size
        assert np.array_equal(np.frombuffer(view, dtype=np.uint8), a)
    cluster[0].delete(name)


def test_a_256_mib_float_array_arrives_identical(cluster):
    a = np.arange(64 << 20, dtype=np.float32)  # 256 MiB
    a[::4097] = -1.5
    cluster[1].put("objects/256M", a)
    view = cluster[2].get("objects/256M", timeout=60)
    b = np.frombuffer(view, dtype=np.float32)
    assert b.shape == a.shape
    assert np.array_equal(a, b)
    del b
    view.release()
    cluster[1].delete("objects/256M")


def test_get_shares_memory_with_the_arena(cluster):
    a = pattern(4 << 20, 7)
    cluster[0].put("zerocopy/x", a)
    view = cluster[1].get("zerocopy/x", timeout=20)
    arr = np.frombuffer(view, dtype=np.uint8)
    base, length = cluster[1].arena_range()
    addr = arr.ctypes.data
    assert base <= addr and addr + arr.nbytes <= base + length, "the view is not in the arena"
    # A second get of the same complete copy hands out the same bytes, not another copy.
    again = np.frombuffer(cluster[1].get("zerocopy/x"), dtype=np.uint8)
    assert again.ctypes.data == addr
    buf = cluster[1].get_buffer("zerocopy/x")
    assert buf.in_arena and buf.address == addr and len(buf) == a.nbytes
    # The array is a read-only view of the arena.
    with pytest.raises(ValueError):
        arr[0] = 1
    assert not arr.flags.owndata
    cluster[0].delete("zerocopy/x")


def test_small_objects_arrive_inline_as_a_private_copy(cluster):
    cluster[0].put("zerocopy/small", b"abc")
    buf = cluster[2].get_buffer("zerocopy/small", timeout=20)
    assert bytes(memoryview(buf)) == b"abc"
    assert len(buf) == 3


def test_view_stays_valid_after_delete_while_referenced(cluster):
    a = pattern(2 << 20, 11)
    cluster[0].put("delete/x", a)
    view = cluster[1].get("delete/x", timeout=20)
    arr = np.frombuffer(view, dtype=np.uint8)
    cluster[0].delete("delete/x")
    with pytest.raises(phalanx.PhalanxError):
        cluster[2].get("delete/x", timeout=1)
    # New objects reuse arena space; the deleted copy's range is still held by `arr`.
    for i in range(4):
        cluster[1].put(f"delete/filler{i}", np.full(2 << 20, 0xEE, dtype=np.uint8))
    assert np.array_equal(arr, a)
    free_before = cluster[1].arena_free()
    del arr
    view.release()
    assert cluster[1].arena_free() == free_before + a.nbytes
    for i in range(4):
        cluster[1].delete(f"delete/filler{i}")


def test_get_into_fills_a_preallocated_array(cluster):
    a = np.linspace(0, 1, 300_000, dtype=np.float64)
    cluster[2].put("into/x", a)
    out = np.empty_like(a)
    assert cluster[0].get_into("into/x", out, timeout=20) == a.nbytes
    assert np.array_equal(out, a)
    small = np.empty(10, dtype=np.float64)
    with pytest.raises(phalanx.InvalidArgument):
        cluster[0].get_into("into/x", small)
    with pytest.raises(BufferError):
        cluster[0].get_into("into/x", b"read-only bytes")


def test_any_buffer_can_be_put(cluster):
    cluster[0].put("buffers/bytes", b"xyz")
    cluster[0].put("buffers/bytearray", bytearray(b"uvw"))
    cluster[0].put("buffers/memoryview", memoryview(b"0123456789")[2:5])
    assert bytes(cluster[1].get("buffers/bytes")) == b"xyz"
    assert bytes(cluster[1].get("buffers/bytearray")) == b"uvw"
    assert bytes(cluster[1].get("buffers/memoryview")) == b"234"
    strided = np.arange(100, dtype=np.int32)[::2]
    with pytest.raises((BufferError, ValueError)):  # NumPy says ValueError: not contiguous
        cluster[0].put("buffers/strided", strided)
    with pytest.raises(TypeError):
        cluster[0].put("buffers/int", 5)


def test_gather_returns_every_object_in_order(cluster):
    names = []
    for k in range(3):
        for size in (100, 200_000):
            name = f"gather/{k}/{size}"
            cluster[k].put(name, np.full(size, k + 1, dtype=np.uint8))
            names.append(name)
    views = cluster[0].gather(names, timeout=20)
    assert [v.nbytes for v in views] == [100, 200_000] * 3
    for name, v in zip(names, views):
        k = int(name.split("/")[1])
        assert np.all(np.frombuffer(v, dtype=np.uint8) == k + 1)


def test_another_python_thread_runs_while_get_blocks(cluster):
    count = 0
    stop = threading.Event()

    def spin():
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = count
        started = time.monotonic()
        # Put later by a third thread: the get blocks until then.
        threading.Timer(0.5, lambda: cluster[2].put("threads/late", b"late" * 1000)).start()
        view = cluster[1].get("threads/late", timeout=10)
        waited = time.monotonic() - started
        during = count - before
    finally:
        stop.set()
        t.join()
    assert bytes(view) == b"late" * 1000
    assert waited >= 0.4
    # The counting thread held the GIL freely while the get waited (tens of thousands of
    # increments per 0.1 s on any machine; a get holding the GIL would allow ~0).
    assert during > 10_000, during
