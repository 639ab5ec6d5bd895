"""One rank of test_reduce.test_allreduce_on_4_processes (started by `python -m phalanx
launch -n 4`): every rank puts its input, all call allreduce, every rank checks the sum."""

import sys
import time

import numpy as np

import phalanx

node = phalanx.init(timeout=60)
n, me = node.num_nodes, node.id


def data(k: int, size: int) -> np.ndarray:
    return (np.arange(size, dtype=np.float32) % 97) * (k + 1)


for size in (1000, 1 << 20, 4 << 20):  # inline, one chunk, many chunks
    node.put(f"ar/{size}/in{me}", data(me, size))
    view = node.allreduce(f"ar/{size}/out", [f"ar/{size}/in{k}" for k in range(n)],
                          op="sum", dtype=np.float32, timeout=60)
    got = np.frombuffer(view, dtype=np.float32)
    want = sum(data(k, size) for k in range(n))
    if not np.array_equal(got, want):
        print(f"rank {me}: allreduce of {size} floats differs", flush=True)
        sys.exit(1)
# Leaving: nobody's objects may vanish while another rank still reads them. Every rank says
# it is done; rank 0 answers once all have, and leaves last, once the others are gone.
node.put(f"ar/done{me}", b"1")
if me == 0:
    for k in range(n):
        node.get(f"ar/done{k}", timeout=60)
    node.put("ar/leave", b"1")
    deadline = time.monotonic() + 30
    while any(node.is_alive(k) for k in range(1, n)) and time.monotonic() < deadline:
        time.sleep(0.01)
else:
    node.get("ar/leave", timeout=60)
print(f"rank {me}: allreduce of {n} inputs verified", flush=True)
node.shutdown()
