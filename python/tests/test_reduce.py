"""reduce, reduce_start, allreduce against NumPy."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import phalanx

HERE = os.path.dirname(os.path.abspath(__file__))


def test_first_k_of_n_equals_numpy_sum_of_the_inputs_it_reports():
    rng = np.random.default_rng(5)
    with phalanx.local_cluster(6, op_timeout=30.0) as c:
        inputs, timers = {}, []
        names = [f"kofn/in{k}" for k in range(6)]
        # Inputs appear one by one, from other threads, in a shuffled order.
        order = rng.permutation(6)

        def put_late(k, delay):
            a = rng.standard_normal(1 << 18).astype(np.float32)
            inputs[names[k]] = a
            t = threading.Timer(delay, lambda: c[k].put(names[k], a))
            t.start()
            timers.append(t)

        for i, k in enumerate(order):
            put_late(int(k), 0.05 * i)
        r = c[0].reduce("kofn/out", names, n=4, op="sum", dtype=np.float32, timeout=20)
        assert len(r.used) == 4 and len(set(r.used)) == 4 and set(r.used) <= set(names)
        got = np.frombuffer(c[3].get("kofn/out", timeout=20), dtype=np.float32)
        # Sum in the order of the tree is not NumPy's order: compare with a float tolerance.
        want = np.sum([inputs[n] for n in r.used], axis=0, dtype=np.float64).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # The inputs the reduce says it used are not the ones left out.
        left = set(names) - set(r.used)
        assert len(left) == 2
        for t in timers:
            t.join()


@pytest.mark.parametrize("op", ["sum", "min", "max", "prod"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.uint8])
def test_every_op_and_dtype_matches_numpy(cluster, op, dtype):
    rng = np.random.default_rng(hash((op, np.dtype(dtype).name)) & 0xFFFF)
    n_elems = 100_000 if op != "prod" else 1000
    names, arrays = [], []
    for k in range(3):
        if np.dtype(dtype).kind == "f":
            a = rng.uniform(0.5, 1.5, n_elems).astype(dtype)
        else:
            a = rng.integers(0, 7, n_elems).astype(dtype)
        name = f"ops/{op}/{np.dtype(dtype).name}/{k}"
        cluster[k].put(name, a)
        names.append(name)
        arrays.append(a)
    target = f"ops/{op}/{np.dtype(dtype).name}/out"
    r = cluster[0].reduce(target, names, op=op, dtype=dtype, timeout=20)
    assert sorted(r.used) == sorted(names)
    got = np.frombuffer(cluster[1].get(target, timeout=20), dtype=dtype)
    fn = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]
    want = arrays[0].copy()
    for a in arrays[1:]:
        want = fn(want, a, dtype=dtype)
    if np.dtype(dtype).kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5)
    else:
        assert np.array_equal(got, want)


def test_reduce_start_names_its_inputs_then_finishes(cluster):
    names = [f"start/in{k}" for k in range(3)]
    for k, name in enumerate(names):
        cluster[k].put(name, np.full(1 << 16, k + 1, dtype=np.int32))
    h = cluster[1].reduce_start("start/out", names, n=2, dtype="int32", timeout=20)
    inputs = h.inputs(timeout=20)
    assert inputs is not None and len(inputs) == 2
    r = h.wait(timeout=20)
    assert h.done()
    assert sorted(r.used) == sorted(inputs)
    got = np.frombuffer(cluster[2].get("start/out", timeout=20), dtype=np.int32)
    assert np.all(got == sum(int(n[-1]) + 1 for n in r.used))
    # The outcome is kept: a second wait returns the same.
    assert h.wait().used == r.used


def test_reduce_start_wait_times_out_and_can_be_waited_again(cluster):
    names = ["late/a", "late/b"]
    cluster[0].put(names[0], np.ones(1000, np.float32))
    h = cluster[0].reduce_start("late/out", names, n=2, timeout=20)
    with pytest.raises(phalanx.Timeout):
        h.wait(timeout=0.2)
    assert not h.done()
    cluster[1].put(names[1], np.ones(1000, np.float32))
    r = h.wait(timeout=20)
    assert sorted(r.used) == names


def test_claims_keep_two_reduces_from_sharing_an_input(cluster):
    names = [f"claims/in{k}" for k in range(4)]
    for k, name in enumerate(names):
        cluster[k % 3].put(name, np.full(4096, 1, np.float32))
    claims = phalanx.Claims()
    h1 = cluster[0].reduce_start("claims/out1", names, n=2, claims=claims, timeout=20)
    h2 = cluster[1].reduce_start("claims/out2", names, n=2, claims=claims, timeout=20)
    used1, used2 = h1.wait(timeout=20).used, h2.wait(timeout=20).used
    assert not set(used1) & set(used2)
    assert claims.owner(used1[0]) == "claims/out1"


def test_allreduce_on_4_processes():
    script = os.path.join(HERE, "allreduce_rank.py")
    p = subprocess.run([sys.executable, "-m", "phalanx", "launch", "-n", "4", "--timeout", "120", script],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0: allreduce of 4 inputs verified" in p.stdout, p.stdout


def test_allreduce_first_combines_the_first_n_on_every_node():
    names = [f"arfirst/in{k}" for k in range(4)]
    arrays = [np.full(1 << 16, k + 1, dtype=np.float32) for k in range(4)]
    with phalanx.local_cluster(4, op_timeout=30.0) as c:
        results, errors = [None] * 4, []

        def rank(k):
            try:
                if k == 3:
                    time.sleep(1.0)  # late: the first three are combined without it
                c[k].put(names[k], arrays[k])
                results[k] = c[k].allreduce_first("arfirst/out", names, 3, dtype=np.float32,
                                                  timeout=20)
            except Exception as e:  # reported below, with the rank
                errors.append((k, e))

        threads = [threading.Thread(target=rank, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        view, used = results[0]
        assert used is not None and sorted(used) == names[:3]
        want = sum(arrays[:3])
        for k in range(4):
            v, u = results[k]
            assert np.array_equal(np.frombuffer(v, dtype=np.float32), want), k
            if k != 0:
                assert u is None
        with pytest.raises(phalanx.InvalidArgument):
            c[0].allreduce_first("arfirst/bad", names, 0)
