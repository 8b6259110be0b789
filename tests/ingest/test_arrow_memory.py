"""Choosing Arrow's allocator for a process."""

import pyarrow as pa
import pytest

from neorec.ingest.arrow_memory import MEMORY_POOLS, use_memory_pool


@pytest.fixture
def restore_pool():
    before = pa.default_memory_pool()
    yield
    pa.set_memory_pool(before)


def test_the_chosen_pool_serves_new_arrow_buffers(restore_pool):
    pool = use_memory_pool("system")
    assert pa.default_memory_pool().backend_name == "system"
    before = pool.bytes_allocated()
    buffer = pa.array(range(100_000), type=pa.int64())
    assert pool.bytes_allocated() >= before + buffer.nbytes


def test_unknown_pool_is_a_clear_error(restore_pool):
    with pytest.raises(ValueError, match=r"unknown Arrow memory pool 'tcmalloc'.*system"):
        use_memory_pool("tcmalloc")
    assert set(MEMORY_POOLS) == {"system", "jemalloc", "mimalloc"}
