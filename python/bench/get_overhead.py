"""What the Python binding adds to a get: the same get loop from Python and from Rust
(``phalanx._native.bench_rust_get``), in one process, on one 2-node local cluster,
alternating rounds so both see the same machine. Prints medians and their ratio.

    python python/bench/get_overhead.py --sizes 1K,64M --iters 200 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import phalanx
from phalanx import _native


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def python_gets(putter, getter, size: int, iters: int, prefix: str) -> list:
    payload = bytes((i * 7 + 3) & 0xFF for i in range(min(size, 1 << 16)))
    payload = (payload * (size // max(len(payload), 1) + 1))[:size] if size else b""
    times = []
    for i in range(iters):
        name = f"{prefix}/{i}"
        putter.put(name, payload)
        t = time.perf_counter()
        v = getter.get(name)
        times.append(time.perf_counter() - t)
        if v.nbytes != size:
            raise RuntimeError(f"got {v.nbytes} bytes of {size}")
        v.release()
        putter.delete(name)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1K,64M")
    p.add_argument("--iters", type=int, default=200, help="gets per round (large sizes: fewer)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    with phalanx.local_cluster(2, arena_size=2 << 30) as c:
        print(f"# get overhead: node 1 gets an object node 0 put; {a.rounds} alternating rounds")
        print(f"# {'size':>8} {'rust med us':>12} {'python med us':>14} {'ratio':>7} {'rust min':>9} {'py min':>9}")
        for s in a.sizes.split(","):
            size = parse_size(s)
            iters = max(5, min(a.iters, (1 << 30) // max(size, 1)))
            rust, py = [], []
            for r in range(a.rounds):
                rust += _native.bench_rust_get(c[0], c[1], size, iters, f"rs/{s}/{r}")
                py += python_gets(c[0], c[1], size, iters, f"py/{s}/{r}")
            mr, mp = statistics.median(rust), statistics.median(py)
            print(f"  {s:>8} {mr * 1e6:12.1f} {mp * 1e6:14.1f} {mp / mr:7.2f} {min(rust) * 1e6:9.1f} {min(py) * 1e6:9.1f}")
            if a.json:
                print(json.dumps({"size": size, "iters": len(rust), "rust_median_s": mr, "python_median_s": mp, "ratio": mp / mr}))


if __name__ == "__main__":
    main()
