"""The pool of recycled arrays (:mod:`neorec.ingest.recycled`): a buffer goes back when the
last array viewing it is gone, never before, and the next request of a similar size gets
the same memory; small requests and idle memory beyond the budget are left to numpy."""

import gc
import threading

import numpy as np
import torch

from neorec.ingest.recycled import ArrayPool

MB = 1 << 20


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_an_array_is_an_uninitialized_numpy_array_of_its_shape_and_dtype():
    pool = ArrayPool(keep_bytes=64 * MB, min_bytes=MB)
    array = pool.empty((3, MB), np.float32)
    assert array.shape == (3, MB) and array.dtype == np.float32
    assert array.flags.c_contiguous and array.flags.writeable
    array[:] = 2.5
    assert float(array.sum()) == 2.5 * 3 * MB
    small = pool.empty(1000, np.int64)
    assert small.base is None  # allocated by numpy as usual
    assert pool.empty(0, np.int64).shape == (0,)


def test_a_buffer_comes_back_when_its_last_view_is_gone_and_is_reused():
    pool = ArrayPool(keep_bytes=64 * MB, min_bytes=MB)
    array = pool.empty(3 * MB // 8, np.int64)
    first = _address(array)
    column = array.reshape(-1, 8)[:, 3]  # a strided view of it
    tensor = torch.from_numpy(array[10:])  # and a tensor of a slice
    del array
    assert pool.idle_bytes == 0
    other = pool.empty(3 * MB // 8, np.int64)
    assert _address(other) != first  # still lent: fresh memory
    del column
    assert pool.idle_bytes == 0
    del tensor
    gc.collect()
    assert pool.idle_bytes == 3 * MB
    again = pool.empty((MB // 8, 5), np.float32)  # 2.5 MB: the same 3 MB buffer
    assert _address(again) == first and pool.idle_bytes == 0


def test_a_request_takes_no_buffer_more_than_twice_its_size():
    pool = ArrayPool(keep_bytes=64 * MB, min_bytes=MB)
    big = pool.empty(8 * MB, np.uint8)
    big_address = _address(big)
    del big
    small = pool.empty(3 * MB, np.uint8)  # 8 MB is more than twice 3 MB
    assert _address(small) != big_address and pool.idle_bytes == 8 * MB
    fitting = pool.empty(4 * MB, np.uint8)
    assert _address(fitting) == big_address and pool.idle_bytes == 0


def test_idle_memory_beyond_the_budget_is_freed():
    pool = ArrayPool(keep_bytes=5 * MB, min_bytes=MB)
    arrays = [pool.empty(2 * MB, np.uint8) for _ in range(4)]
    del arrays
    assert pool.idle_bytes == 4 * MB  # two of 2 MB kept, the third and fourth freed


def test_arrays_dying_on_other_threads_come_back_once_each():
    pool = ArrayPool(keep_bytes=1 << 40, min_bytes=MB)
    made = [pool.empty(MB + 1 + k, np.uint8) for k in range(64)]  # 2 MB buffers
    addresses = {_address(a) for a in made}
    barrier = threading.Barrier(4)

    def drop(arrays):
        barrier.wait()
        arrays.clear()

    threads = [threading.Thread(target=drop, args=(made[k::4],)) for k in range(4)]
    del made
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.idle_bytes == 64 * 2 * MB
    again = [pool.empty(2 * MB, np.uint8) for _ in range(64)]
    assert {_address(a) for a in again} == addresses and pool.idle_bytes == 0
