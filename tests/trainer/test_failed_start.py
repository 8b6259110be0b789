"""A run whose setting up fails half-way releases what it had acquired: reader threads and
gRPC channels, the first epoch's background batch thread, store tiers, open files, the
TensorBoard writer (and a run that ends releases its writer too)."""

import os
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from neorec.ingest.errors import DataError
from neorec.trainer.config import TrainConfig
from neorec.trainer.distributed import SINGLE_PROCESS
from neorec.trainer.run import loop as loop_module
from neorec.trainer.run import run_dir as run_directory
from neorec.trainer.run.loop import TrainingRun
from neorec.trainer.run.train import train
from tests.ingest.workers import start_worker


def _config(dataset, run_dir, loop: dict | None = None, **data) -> TrainConfig:
    return TrainConfig.from_dict({
        "data": {"path": str(dataset.root), **data},
        "model": {"max_table_rows": 5000, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32, 1]},
        "train": {"batch_size": 256, "eval_batch_size": 1000, "background_batches": 2, **(loop or {})},
        "embedding_store": {"tables": {"t_C1": 0.005, "t_C3": 0.02}},
        "run": {"dir": str(run_dir)},
    })


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _released(threads_before: set[threading.Thread], fds_before: set[str]) -> None:
    """Every thread started since ``threads_before`` ended, every descriptor opened since
    ``fds_before`` closed."""
    deadline = time.monotonic() + 10
    while True:
        threads = set(threading.enumerate()) - threads_before
        fds = _open_fds() - fds_before
        if not threads and not fds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not threads, threads
    assert not fds, [os.readlink(f"/proc/self/fd/{fd}") for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]


def _fails_and_releases(config: TrainConfig, error: type[BaseException]) -> None:
    with pytest.raises(error):  # once: what a process loads once (gRPC's, Numba's) is loaded
        TrainingRun(config, SINGLE_PROCESS, overwrite=True)
    threads, fds = set(threading.enumerate()), _open_fds()
    with pytest.raises(error):
        TrainingRun(config, SINGLE_PROCESS, overwrite=True)
    _released(threads, fds)


def test_a_bad_eval_split_after_the_train_reader_started_releases_it(criteo_dataset, tmp_path):
    _fails_and_releases(_config(criteo_dataset, tmp_path / "run", eval_split="no-such-split"), DataError)


def test_a_bad_eval_split_releases_the_reader_services_channels_and_threads(criteo_dataset, tmp_path):
    worker = start_worker()
    try:
        _fails_and_releases(_config(criteo_dataset, tmp_path / "run", eval_split="no-such-split",
                                    ingest=[worker.address]), DataError)
    finally:
        worker.stop()


class Failed(Exception):
    """Stands for a failure late in setting up (after the readers, background batches and store)."""


@pytest.mark.parametrize("through_services", [False, True])
def test_a_late_failure_releases_the_background_batch_thread_and_the_store(criteo_dataset, tmp_path, monkeypatch,
                                                                           through_services):
    def fail(config) -> None:
        raise Failed()

    monkeypatch.setattr(loop_module, "compile_kernels", fail)
    worker = start_worker() if through_services else None
    try:
        config = _config(criteo_dataset, tmp_path / "run", ingest=[worker.address] if worker else [])
        _fails_and_releases(config, Failed)
    finally:
        if worker is not None:
            worker.stop()


class EventWriter:
    """Stands for ``torch.utils.tensorboard.SummaryWriter`` where TensorBoard is not installed:
    like it, an open event file and a thread from when it is made until :meth:`close`."""

    made: list["EventWriter"] = []

    def __init__(self, log_dir: str) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.file = (Path(log_dir) / "events").open("a")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stop.wait, name="event-writer", daemon=True)
        self.thread.start()
        EventWriter.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.file.write(f"{tag} {step} {value}\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.file.close()


@pytest.fixture(params=["stand-in", "tensorboard"])
def event_writer(request, monkeypatch) -> str:
    """The writer the run gets: the stand-in :class:`EventWriter` (always), TensorBoard's own
    (where it is installed)."""
    if request.param == "tensorboard":
        pytest.importorskip("tensorboard")
    else:
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=EventWriter))
        EventWriter.made.clear()
    return request.param


def test_a_failure_after_the_tensorboard_writer_opened_releases_it(criteo_dataset, tmp_path, monkeypatch,
                                                                    event_writer):
    def fail(*args) -> None:
        raise Failed()

    monkeypatch.setattr(loop_module, "check_same_steps", fail)  # the last step of setting up
    _fails_and_releases(_config(criteo_dataset, tmp_path / "run", loop={"tensorboard": True}), Failed)
    if event_writer == "stand-in":
        assert len(EventWriter.made) == 2 and all(w.file.closed for w in EventWriter.made)


def test_a_run_that_ends_closes_its_tensorboard_writer(criteo_dataset, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=EventWriter))
    EventWriter.made.clear()
    train(_config(criteo_dataset, tmp_path / "run", loop={"tensorboard": True, "max_steps": 4, "log_every": 2}))
    (writer,) = EventWriter.made
    assert writer.file.closed and not writer.thread.is_alive()
    assert "train/loss 2 " in (tmp_path / "run" / "tensorboard" / "events").read_text()


@pytest.mark.parametrize("failure", [MemoryError("Unable to allocate 59.6 GiB for an array with shape (2000000001, 8)"),
                                     RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                                  "64000000032 bytes")])
def test_a_model_the_host_cannot_allocate_is_a_config_error_that_releases_all(criteo_dataset, tmp_path, monkeypatch,
                                                                              failure):
    """``sharding.memory_per_rank`` may promise more than the host has: the allocation's
    failure names the settings to change (numpy's MemoryError, torch's RuntimeError)."""
    from neorec.trainer.config import ConfigError
    from neorec.trainer.embedding import fused

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(fused, "initial_table_weight", fail)
    config = TrainConfig.from_dict({"data": {"path": str(criteo_dataset.root)},
                                    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32, 1]},
                                    "run": {"dir": str(tmp_path / "run")}})
    _fails_and_releases(config, ConfigError)
    with pytest.raises(ConfigError, match=r"^the model does not fit this host's memory \(.*allocate.*\): lower "
                                          r"model.max_table_rows .* sharding.memory_per_rank is 16GiB\)$"):
        train(config)


def _old_run(run_dir: Path) -> dict[str, str]:
    """An earlier run's files in ``run_dir``: path → contents."""
    files = {"config.json": "{}", "metrics.jsonl": "{}\n", "summary.json": '{"steps": 4}',
             "checkpoint/step-4/manifest.json": "{}"}
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return files


@pytest.mark.parametrize("refusal", ["no tensorboard", "store service unreachable", "model too large"])
def test_a_run_refused_in_setting_up_leaves_the_run_it_would_overwrite_as_it_was(criteo_dataset, tmp_path,
                                                                                 monkeypatch, refusal):
    """A refused ``--overwrite`` leaves the old run (docs/checkpoints.md): what a run needs
    beyond its config and data (TensorBoard installed, a store service that serves it, the
    memory for its model) is judged before the old run goes; a fresh directory is left
    empty, for the next run."""
    from neorec.common.errors import UserError
    from neorec.trainer.embedding import fused

    if refusal == "no tensorboard":
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails
        config = _config(criteo_dataset, tmp_path / "run", loop={"tensorboard": True})
    elif refusal == "model too large":
        def fail(*args, **kwargs):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 64000000032 bytes")

        monkeypatch.setattr(fused, "initial_table_weight", fail)
        config = TrainConfig.from_dict({**_config(criteo_dataset, tmp_path / "run").to_dict(),
                                        "embedding_store": {"tables": {}}})  # tables in memory only
    else:
        config = TrainConfig.from_dict({**_config(criteo_dataset, tmp_path / "run").to_dict(),
                                        "embedding_store": {"tables": {"t_C1": 0.005}, "service": "127.0.0.1:1"}})
    files = _old_run(tmp_path / "run")
    expected = {"no tensorboard": "tensorboard package", "model too large": "does not fit this host's memory"}
    with pytest.raises(UserError, match=expected.get(refusal, "127.0.0.1:1")):
        TrainingRun(config, SINGLE_PROCESS, overwrite=True)
    left = {str(p.relative_to(tmp_path / "run")): p.read_text() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert {name: text for name, text in left.items() if name != ".lock"} == files
    with pytest.raises(UserError):
        TrainingRun(TrainConfig.from_dict({**config.to_dict(), "run": {"dir": str(tmp_path / "fresh")}}),
                    SINGLE_PROCESS)
    assert run_directory.check_claim(tmp_path / "fresh") == []  # no run's file there: the next run starts
