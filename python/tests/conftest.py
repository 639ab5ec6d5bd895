import pytest

import phalanx


@pytest.fixture(scope="module")
def cluster():
    """Three nodes in this process, shared by a module's tests (names are unique per test)."""
    with phalanx.local_cluster(3, arena_size=1 << 30, op_timeout=30.0) as c:
        yield c
