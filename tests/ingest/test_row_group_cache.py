"""The reader service's row group cache: one read per row group and epoch, bounded memory."""

import os
import threading
import time

import pyarrow as pa
import pytest

from neorec.ingest.row_group_cache import RowGroupCache

COLUMNS = ("a",)


def _table(rows: int) -> pa.Table:
    return pa.table({"a": pa.array(range(rows), type=pa.int64())})


class CountingLoader:
    """``load`` callables that count their calls per row group (and can be slow or fail)."""

    def __init__(self, rows: int = 1000, delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.calls: dict[int, int] = {}
        self.rows, self.delay_s, self.error = rows, delay_s, error

    def __call__(self, row_group: int):
        def load() -> pa.Table:
            self.calls[row_group] = self.calls.get(row_group, 0) + 1
            time.sleep(self.delay_s)
            if self.error is not None:
                raise self.error
            return _table(self.rows)
        return load


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "part.parquet"
    path.write_bytes(b"stand-in: the cache only stats the file")
    return str(path)


def test_concurrent_readers_of_a_row_group_share_one_read(data_file):
    cache, loader = RowGroupCache(), CountingLoader(delay_s=0.2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.read(data_file, 3, COLUMNS, 0, loader(3))))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loader.calls == {3: 1} and (cache.misses, cache.hits) == (1, 3)
    assert all(table is results[0] for table in results)


def test_other_epochs_columns_and_rewritten_files_read_again(data_file):
    cache, loader = RowGroupCache(), CountingLoader()
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    assert loader.calls == {0: 1}
    cache.read(data_file, 0, COLUMNS, 1, loader(0))  # the next epoch reads from Parquet
    cache.read(data_file, 0, ("a", "b"), 1, loader(0))
    stat = os.stat(data_file)
    os.utime(data_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    cache.read(data_file, 0, COLUMNS, 1, loader(0))
    assert loader.calls == {0: 4}


def test_a_failed_read_reaches_every_waiter_and_is_not_kept(data_file):
    cache = RowGroupCache()
    failing = CountingLoader(delay_s=0.2, error=OSError("disk on fire"))
    errors = []

    def read():
        try:
            cache.read(data_file, 1, COLUMNS, 0, failing(1))
        except OSError as err:
            errors.append(str(err))

    threads = [threading.Thread(target=read) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == ["disk on fire"] * 3 and failing.calls == {1: 1}
    working = CountingLoader()
    assert cache.read(data_file, 1, COLUMNS, 0, working(1)).num_rows == 1000
    assert working.calls == {1: 1}


def test_least_recently_used_tables_go_beyond_the_budget(data_file):
    size = _table(1000).nbytes
    cache, loader = RowGroupCache(capacity_bytes=2 * size), CountingLoader()
    for row_group in (0, 1):
        cache.read(data_file, row_group, COLUMNS, 0, loader(row_group))
    cache.read(data_file, 0, COLUMNS, 0, loader(0))  # 0 is now the most recently used
    cache.read(data_file, 2, COLUMNS, 0, loader(2))  # evicts 1
    for row_group in (0, 2, 1):
        cache.read(data_file, row_group, COLUMNS, 0, loader(row_group))
    assert loader.calls == {0: 1, 1: 2, 2: 1}


def test_a_table_above_the_budget_is_kept_until_the_next_read(data_file):
    cache, loader = RowGroupCache(capacity_bytes=1), CountingLoader()
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    cache.read(data_file, 1, COLUMNS, 0, loader(1))
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    assert loader.calls == {0: 2, 1: 1}


def test_a_window_decoded_to_its_last_row_is_dropped(data_file):
    cache, loader = RowGroupCache(), CountingLoader(rows=1000)
    window = [(data_file, 0), (data_file, 1)]
    for row_group in (0, 1, 2):
        cache.read(data_file, row_group, COLUMNS, 0, loader(row_group))
    cache.rows_decoded(window, COLUMNS, 0, 500, 2000, 2000)
    cache.rows_decoded(window, COLUMNS, 1, 0, 2000, 2000)  # another epoch's window: nothing of epoch 0 goes
    cache.rows_decoded(window, ("a", "b"), 0, 0, 2000, 2000)  # other columns: the same
    cache.rows_decoded(window, COLUMNS, 0, 700, 1200, 2000)  # rows decoded again (a retried task) count once
    for row_group in (0, 1, 2):  # still cached: rows [0, 500) are to come
        cache.read(data_file, row_group, COLUMNS, 0, loader(row_group))
    assert loader.calls == {0: 1, 1: 1, 2: 1}
    cache.rows_decoded(window, COLUMNS, 0, 0, 500, 2000)
    for row_group in (2, 0, 1):  # the window's tables went, the other row group stayed
        cache.read(data_file, row_group, COLUMNS, 0, loader(row_group))
    assert loader.calls == {0: 2, 1: 2, 2: 1}


def test_a_count_lasts_while_its_window_has_tables_and_goes_with_them(data_file):
    size = _table(1000).nbytes
    cache, loader = RowGroupCache(capacity_bytes=2 * size), CountingLoader(rows=1000)
    window = [(data_file, 0)]
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    cache.rows_decoded(window, COLUMNS, 0, 0, 400, 1000)
    cache.read(data_file, 1, COLUMNS, 0, loader(1))  # a read that evicts nothing keeps the count
    cache.rows_decoded(window, COLUMNS, 0, 400, 1000, 1000)
    cache.read(data_file, 0, COLUMNS, 0, loader(0))  # the count completed: read again
    assert loader.calls == {0: 2, 1: 1}
    cache.rows_decoded(window, COLUMNS, 0, 0, 400, 1000)  # the other rows went to another worker
    cache.read(data_file, 2, COLUMNS, 0, loader(2))
    cache.read(data_file, 3, COLUMNS, 0, loader(3))  # evicts row group 0, and its count with it
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    cache.rows_decoded(window, COLUMNS, 0, 400, 1000, 1000)  # counts from nothing again: the table stays
    cache.read(data_file, 0, COLUMNS, 0, loader(0))
    assert loader.calls == {0: 3, 1: 1, 2: 1, 3: 1}


def test_a_table_still_being_read_when_its_window_completes_reaches_its_readers(data_file):
    cache, loader = RowGroupCache(), CountingLoader(delay_s=0.3)
    results = []
    reader = threading.Thread(target=lambda: results.append(cache.read(data_file, 0, COLUMNS, 0, loader(0))))
    reader.start()
    time.sleep(0.1)
    cache.rows_decoded([(data_file, 0)], COLUMNS, 0, 0, 1000, 1000)
    waiter = cache.read(data_file, 0, COLUMNS, 0, loader(0))
    reader.join()
    assert results[0] is waiter and loader.calls == {0: 1}
