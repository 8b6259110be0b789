"""A run interrupted while its background batch thread waits in the reader (a stream that
delivers nothing, its service still healthy) ends at once: the reader is closed before the
thread is joined, so the thread's wait ends."""

from __future__ import annotations

import threading
import time

import pytest

from neorec.trainer.run import loop as loop_module
from neorec.trainer.run.train import train
from tests.trainer.test_train import _config

STREAM_TIMEOUT_S = 60.0
"""How long the stuck stream would hold a thread that nobody interrupts."""


class StuckReader:
    """The train reader, whose epoch delivers ``batches`` batches and then waits for more
    until it is closed (or :data:`STREAM_TIMEOUT_S`)."""

    def __init__(self, reader, batches: int) -> None:
        self.reader = reader
        self.batches = batches
        self.closed = threading.Event()
        self.waiting = threading.Event()

    def plan(self, epoch: int):
        return self.reader.plan(epoch)

    def epoch(self, epoch: int, first_step: int = 0):
        for i, batch in enumerate(self.reader.epoch(epoch, first_step)):
            if i == self.batches:
                self.waiting.set()
                self.closed.wait(STREAM_TIMEOUT_S)
                raise RuntimeError("the stream ended")
            yield batch

    def close(self) -> None:
        self.closed.set()
        self.reader.close()


def test_an_interrupt_while_the_background_batch_thread_waits_in_the_reader_ends_at_once(criteo_dataset, tmp_path,
                                                                                          monkeypatch):
    make_reader = loop_module.make_reader
    stuck: list[StuckReader] = []
    interrupted_at: list[float] = []

    def reader(dataset, split, *args):
        made = make_reader(dataset, split, *args)
        if split == "train":
            stuck.append(StuckReader(made, batches=5))
            return stuck[-1]
        return made

    def interrupt_at_step_5(report) -> None:
        if report.global_step == 5:
            assert stuck[0].waiting.wait(30)
            interrupted_at.append(time.monotonic())
            raise KeyboardInterrupt

    monkeypatch.setattr(loop_module, "make_reader", reader)
    with pytest.raises(KeyboardInterrupt):
        train(_config(criteo_dataset, tmp_path / "run", epochs=1, background_batches=4), progress=interrupt_at_step_5)
    assert time.monotonic() - interrupted_at[0] < 10  # not the stuck stream's 60 s
    assert stuck[0].closed.is_set()
    assert not [t for t in threading.enumerate() if t.name != "MainThread" and t.is_alive()
                and "BackgroundIterator" in repr(getattr(t, "_target", None))]
