"""A task's NumPy result stored two ways: computed into a temporary and ``put`` (copied into
the arena), or computed straight into the arena through ``Node.create`` (no copy). One node
of a 2-node local cluster; the two ways alternate, so both see the same machine. Prints the
medians and their ratio, and checks every stored result.

    python python/bench/create_vs_put.py --size 16M --iters 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import phalanx


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="16M", help="bytes of the float32 result")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    n = parse_size(args.size) // 4
    a = np.random.default_rng(1).random(n, dtype=np.float32)
    want = a * 2.0
    times = {"put": [], "create": []}
    with phalanx.local_cluster(2, arena_size=max(1 << 28, 8 * a.nbytes)) as c:
        node = c[0]
        for i in range(args.iters):
            for how in times:
                name = f"bench/{how}/{i}"
                t = time.perf_counter()
                if how == "put":
                    node.put(name, a * 2.0)
                else:
                    with node.create(name, a.nbytes) as w:
                        np.multiply(a, 2.0, out=np.frombuffer(w, np.float32))
                times[how].append(time.perf_counter() - t)
                got = np.frombuffer(node.get(name), np.float32)
                assert np.array_equal(got, want), f"{how} stored other bytes"
                del got
                node.delete(name)
    put, create = (statistics.median(times[h]) * 1e3 for h in ("put", "create"))
    print(
        f"{a.nbytes} B float32 a*2 stored, median of {args.iters}: "
        f"put(a * 2) {put:.3f} ms, create + np.multiply(out=) {create:.3f} ms, "
        f"ratio {create / put:.2f}"
    )


if __name__ == "__main__":
    main()
