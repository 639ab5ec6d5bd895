"""Asynchronous parameter server (Hoplite §5.2) in Python with NumPy, one process per node:
rank 0 is the server, ranks 1..N-1 are workers. A worker fetches the model version it was
given, computes for a random time, and puts a float32 gradient as large as the model. The
server applies the first W/2 gradients to become ready and hands the new version to exactly
the workers whose gradients it used.

Phalanx: an update is one subset reduce, ``model/v+1 = model/v + first k gradients``
(``required=[model/v]`` keeps the model in, the gradients fill the rest in arrival order).
The server learns the chosen gradients as soon as the reduce tree is full
(``ReduceHandle.inputs``), gives ``model/v+1`` to those workers while it is still being
reduced (they stream it from its partial copies), and starts the next update on the partial
result; two updates are in flight at once and share one ``Claims`` pool so no gradient is
used twice. The model bytes never pass through the server.

Star baseline (what a task system without collectives does): the server pulls the gradients
one by one in arrival order straight from their workers, adds them with NumPy, puts the new
model and hands it to one chosen worker after another (each pulls it from the server only).

Verified: each worker checks the model it fetched against the version's expected tile (the
server publishes it once the version is final); the server checks that every gradient it
used was computed from the version that worker was given, and at the end that the final
model equals a serial replay of the logged updates.

    python -m phalanx launch -n 8 python/examples/param_server.py --size 64M --compare
    python -m phalanx launch --config cluster/examples/netns-8.toml \\
        python/examples/param_server.py --size 64M --compare
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from typing import Dict, List, Tuple

import numpy as np

import phalanx

TILE = 4096  # floats: models and gradients are this tile repeated, so checks are cheap
STOP = -1


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def model0_tile() -> np.ndarray:
    return (np.arange(TILE) % 17).astype(np.float32)


def grad_tile(w: int, it: int, v: int) -> np.ndarray:
    """Small integers: sums stay exact in float32, so every check is an exact compare."""
    return ((np.arange(TILE) * (w + 1) + it * 3 + v) % 5).astype(np.float32)


def tiled(tile: np.ndarray, size: int) -> np.ndarray:
    return np.tile(tile, size // (TILE * 4))


def is_tiled(view: memoryview, tile: np.ndarray) -> bool:
    m = np.frombuffer(view, dtype=np.float32)
    return m.size % TILE == 0 and bool((m.reshape(-1, TILE) == tile).all())


def as_int(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.int64)[0])


class Run:
    """Names of one algorithm's objects, and the shared settings."""

    def __init__(self, node: phalanx.Node, algo: str, a: argparse.Namespace):
        self.node, self.algo, self.a = node, algo, a
        self.p = f"ps/{algo}/"

    def id(self, s: str) -> str:
        return self.p + s


# ----------------------------------------------------------------------------- worker


def worker(r: Run) -> int:
    node, a, w = r.node, r.a, r.node.id
    rng = random.Random(a.seed * 1000 + w)
    it, fetched = 0, 0
    while True:
        v = as_int(node.get(r.id(f"assign/{w}/{it}"), timeout=a.timeout))
        node.delete(r.id(f"assign/{w}/{it}"))
        if v == STOP:
            return fetched
        source = 0 if r.algo == "star" else None
        model = node.get(r.id(f"model/{v}"), timeout=a.timeout, source=source)
        ok = is_tiled(model, np.frombuffer(node.get(r.id(f"tile/{v}"), timeout=a.timeout), np.float32))
        model.release()
        fetched += 1
        if r.algo == "star":
            node.put(r.id(f"have/{w}/{it}"), b"h")
        t = time.monotonic()
        g = tiled(grad_tile(w, it, v), a.size)
        compute = max(0.0, rng.uniform(a.compute_ms - a.jitter_ms, a.compute_ms + a.jitter_ms) / 1e3)
        time.sleep(max(0.0, compute - (time.monotonic() - t)))
        node.put(r.id(f"gmeta/{w}/{it}"), np.array([v, int(ok)], dtype=np.int64))
        node.put(r.id(f"grad/{w}/{it}"), g)
        del g
        it += 1


# ----------------------------------------------------------------------------- server


class Book:
    """The server's bookkeeping, shared by both algorithms."""

    def __init__(self, r: Run):
        self.r, self.node = r, r.node
        self.workers = list(range(1, self.node.num_nodes))
        self.cur_it = {w: 0 for w in self.workers}
        self.given: Dict[Tuple[int, int], int] = {}
        self.tiles = {0: model0_tile()}
        self.log: List[List[Tuple[int, int, int]]] = []
        self.deleted_below = 0
        self.node.put(r.id("model/0"), tiled(self.tiles[0], r.a.size))
        self.node.put(r.id("tile/0"), self.tiles[0])
        for w in self.workers:
            self.hand(w, 0, 0)

    def grad(self, w: int, it: int) -> str:
        return self.r.id(f"grad/{w}/{it}")

    def hand(self, w: int, it: int, v: int) -> None:
        self.cur_it[w] = it
        self.given[(w, it)] = v
        self.node.put(self.r.id(f"assign/{w}/{it}"), np.array([v], dtype=np.int64))

    def advance(self, w: int, v: int) -> None:
        self.hand(w, self.cur_it[w] + 1, v)

    def record(self, u: int, used: List[Tuple[int, int]]) -> None:
        """Update u (model/u -> model/u+1) used these gradients: check them, publish the new
        version's tile, delete what nobody needs any more."""
        tile = self.tiles[u].copy()
        entry = []
        for w, it in used:
            meta = np.frombuffer(self.node.get(self.r.id(f"gmeta/{w}/{it}"), timeout=self.r.a.timeout), np.int64)
            seen, ok = int(meta[0]), bool(meta[1])
            if not ok:
                raise RuntimeError(f"worker {w} iteration {it}: the model it fetched was not version {seen}")
            if seen != self.given[(w, it)]:
                raise RuntimeError(f"worker {w} iteration {it} used version {seen}, was given {self.given[(w, it)]}")
            tile += grad_tile(w, it, seen)
            entry.append((w, it, seen))
        self.node.put(self.r.id(f"tile/{u + 1}"), tile)
        self.tiles[u + 1] = tile
        for w, it, _ in entry:
            self.node.delete(self.grad(w, it))
            self.node.delete(self.r.id(f"gmeta/{w}/{it}"))
            del self.given[(w, it)]
        self.log.append(entry)

    def collect_garbage(self, done: int) -> None:
        """Deletes versions below every version a worker was given and below `done`."""
        keep_from = min([done] + list(self.given.values()))
        for v in range(self.deleted_below, keep_from):
            self.node.delete(self.r.id(f"model/{v}"))
            self.node.delete(self.r.id(f"tile/{v}"))
            self.tiles.pop(v, None)
        self.deleted_below = max(self.deleted_below, keep_from)

    def finish(self) -> None:
        """Checks the final model against a serial replay, stops the workers, cleans up."""
        last = len(self.log)
        replay = model0_tile()
        for entry in self.log:
            for w, it, v in entry:
                replay = replay + grad_tile(w, it, v)
        if not is_tiled(self.node.get(self.r.id(f"model/{last}"), timeout=self.r.a.timeout), replay):
            raise RuntimeError(f"final model differs from the serial replay of {last} updates")
        for w in self.workers:
            self.node.put(self.r.id(f"assign/{w}/{self.cur_it[w] + 1}"), np.array([STOP], dtype=np.int64))


def server_phalanx(r: Run, batch: int) -> Book:
    a, node = r.a, r.node
    book = Book(r)
    claims = phalanx.Claims()
    flights: List[dict] = []
    consumed: List[str] = []
    started = done = 0
    end = time.monotonic() + a.secs
    while done < a.updates:
        starting = started < a.updates and time.monotonic() < end
        if not starting and not flights:
            break
        if starting and len(flights) < a.pipeline and (not flights or flights[-1]["placed"] is not None):
            u = started
            offered = {book.grad(w, book.cur_it[w]): (w, book.cur_it[w]) for w in book.workers}
            model = r.id(f"model/{u}")
            h = node.reduce_start(r.id(f"model/{u + 1}"), [model, *offered], n=min(batch, len(offered)) + 1,
                                  op="sum", dtype=np.float32, required=[model], claims=claims,
                                  timeout=a.timeout)
            flights.append({"u": u, "h": h, "offered": offered, "placed": None})
            started += 1
        # The newest update's inputs; this short wait paces the loop.
        f = flights[-1] if flights else None
        if f is not None and f["placed"] is None:
            inputs = f["h"].inputs(timeout=0.003)
            if inputs is not None:
                f["placed"] = [f["offered"][i][0] for i in inputs if i in f["offered"]]
                for w in f["placed"]:
                    book.advance(w, f["u"] + 1)
        # Finished updates, oldest first (each one's result is the next one's input).
        while flights and flights[0]["h"].done():
            f = flights.pop(0)
            res = f["h"].wait()
            if f["placed"] is None:  # finished before we looked at its inputs
                inputs = f["h"].inputs(timeout=0) or []
                f["placed"] = [f["offered"][i][0] for i in inputs if i in f["offered"]]
                for w in f["placed"]:
                    book.advance(w, f["u"] + 1)
            used = [f["offered"][i] for i in res.used if i in f["offered"]]
            for w, _ in used:
                if w not in f["placed"]:  # a failure replaced a placed gradient by a spare
                    book.advance(w, f["u"] + 1)
            book.record(f["u"], used)
            consumed += [book.grad(w, it) for w, it in used]
            still = []
            for gid in consumed:
                if any(gid in g["offered"] for g in flights):
                    still.append(gid)
                else:
                    claims.forget(gid)
            consumed = still
            done += 1
            book.collect_garbage(done)
    return book


def server_star(r: Run, batch: int) -> Book:
    a, node = r.a, r.node
    book = Book(r)
    model = tiled(book.tiles[0], a.size)
    ready: "queue.Queue[int]" = queue.Queue()

    def watch(w: int, it: int) -> None:
        def wait() -> None:
            try:
                node.get(r.id(f"gmeta/{w}/{it}"), timeout=a.timeout)
                ready.put(w)
            except phalanx.PhalanxError as e:
                print(f"[server] gradient {it} of worker {w}: {e}", file=sys.stderr)

        threading.Thread(target=wait, daemon=True).start()

    for w in book.workers:
        watch(w, 0)
    end = time.monotonic() + a.secs
    u = 0
    while u < a.updates and time.monotonic() < end:
        k = min(batch, len(book.workers))
        used = []
        nxt = model.copy()
        while len(used) < k:  # the gradients, one by one in arrival order
            w = ready.get(timeout=a.timeout)
            it = book.cur_it[w]
            g = node.get(book.grad(w, it), timeout=a.timeout, source=w)
            nxt += np.frombuffer(g, dtype=np.float32)
            g.release()
            used.append((w, it))
        model = nxt
        book.record(u, used)
        v = u + 1
        node.put(r.id(f"model/{v}"), model)
        for w, it in used:  # the new model, to one chosen worker after another
            book.advance(w, v)
            have = r.id(f"have/{w}/{it + 1}")
            node.get(have, timeout=a.timeout)
            node.delete(have)
            watch(w, it + 1)
        u += 1
        book.collect_garbage(u)
    return book


# ----------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="64M", help="model and gradient bytes (a multiple of 16K)")
    p.add_argument("--compute-ms", type=float, default=200.0)
    p.add_argument("--jitter-ms", type=float, default=100.0)
    p.add_argument("--updates", type=int, default=1000, help="stop after this many updates")
    p.add_argument("--secs", type=float, default=30.0, help="or after this long (per algorithm)")
    p.add_argument("--batch", type=int, default=None, help="gradients per update (default W/2)")
    p.add_argument("--pipeline", type=int, default=2, help="Phalanx: updates in flight at once")
    p.add_argument("--algo", default="phalanx", choices=["phalanx", "star"])
    p.add_argument("--compare", action="store_true", help="run Phalanx, then the star baseline")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    a.size = parse_size(a.size)
    if a.size <= 0 or a.size % (TILE * 4):
        p.error(f"--size must be a positive multiple of {TILE * 4} bytes")
    node = phalanx.init(timeout=60)
    n = node.num_nodes
    if n < 2:
        p.error("needs at least 2 nodes: a server and a worker")
    batch = max(1, a.batch or (n - 1) // 2)
    algos = ["phalanx", "star"] if a.compare else [a.algo]
    results = {}
    for algo in algos:
        r = Run(node, algo, a)
        if node.id != 0:
            worker(r)
            continue
        t = time.monotonic()
        book = (server_phalanx if algo == "phalanx" else server_star)(r, batch)
        secs = time.monotonic() - t
        book.finish()
        results[algo] = (len(book.log), secs)
    # Leaving: the server goes last, once every worker has said it is done.
    node.put(f"ps/left/{node.id}", b"1")
    if node.id == 0:
        for k in range(1, n):
            node.get(f"ps/left/{k}", timeout=a.timeout)
        node.put("ps/leave", b"1")
        deadline = time.monotonic() + 30
        while any(node.is_alive(k) for k in range(1, n)) and time.monotonic() < deadline:
            time.sleep(0.01)
        mib = a.size >> 20
        print(f"# param_server.py: {n - 1} workers, batch {batch}, model/gradient {mib} MiB float32, "
              f"compute {a.compute_ms:g}±{a.jitter_ms:g} ms")
        print(f"# {'algo':>8} {'updates':>8} {'secs':>8} {'updates/s':>10}")
        for algo, (updates, secs) in results.items():
            print(f"  {algo:>8} {updates:>8} {secs:8.2f} {updates / secs:10.3f}")
            if a.json:
                print(json.dumps({"bench": "param_server.py", "algo": algo, "workers": n - 1, "batch": batch,
                                  "size": a.size, "updates": updates, "secs": secs,
                                  "updates_per_s": updates / secs}))
        if len(results) == 2:
            rate = {k: u / s for k, (u, s) in results.items()}
            print(f"# phalanx/star updates-per-second ratio: {rate['phalanx'] / rate['star']:.2f}")
        print("# verified: every fetched model matched its version; final model == serial replay of the logged updates")
    else:
        node.get("ps/leave", timeout=a.timeout)
    node.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
