"""Run an iterator in a background thread, a bounded number of items ahead."""

from __future__ import annotations

import queue
import threading
import time
from typing import Generator, Iterator, TypeVar

T = TypeVar("T")

_END = object()


class BackgroundIterator(Iterator[T]):
    """Iterates ``source`` in a daemon thread, keeping at most ``depth`` items ready.

    An exception raised by ``source`` is re-raised by ``__next__`` in the consumer.
    ``wait_seconds`` accumulates the time the consumer spent waiting for items.
    """

    def __init__(self, source: Iterator[T], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(source,), daemon=True)
        self._thread.start()

    def _run(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
        except BaseException as err:  # handed to the consumer
            self._put(err)
            return
        finally:
            if isinstance(source, Generator):
                source.close()  # runs the source's cleanup now, in this thread
        self._put(_END)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        started = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - started
        if item is _END:
            self._thread.join()
            raise StopIteration
        if isinstance(item, BaseException):
            self._thread.join()
            raise item
        return item

    def close(self) -> None:
        """Stop the background thread (items not consumed are dropped)."""
        self._stop.set()
        self._thread.join()
