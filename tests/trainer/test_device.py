"""Rank → device, and the device a run, its restore and its evaluation use (CUDA counts
patched: no GPU here)."""

import dataclasses

import pytest
import torch

from neorec.common.errors import UserError
from neorec.trainer import checkpoint
from neorec.trainer.checkpoint.restore import load_dense
from neorec.trainer.config import ConfigError, TrainConfig
from neorec.trainer.device import DeviceError, HostToDevice, resolve_device
from neorec.trainer.distributed import DistributedContext
from neorec.trainer.planner.from_config import for_job
from neorec.trainer.run.train import evaluate_checkpoint, train
from tests.trainer.test_train import _config


@pytest.fixture
def gpus(monkeypatch):
    def patch(count: int) -> None:
        monkeypatch.setattr("neorec.trainer.device.cuda_devices", lambda: count)
    return patch


def test_each_local_rank_gets_the_gpu_of_its_number(gpus):
    gpus(4)
    assert [resolve_device("cuda", r, 4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert resolve_device("auto", 1, 2) == torch.device("cuda", 1)
    assert resolve_device("cpu", 3, 4) == torch.device("cpu")


def test_more_local_ranks_than_gpus_is_a_named_error_not_a_shared_gpu(gpus):
    gpus(2)
    with pytest.raises(DeviceError, match="3 ranks on this host but 2 visible GPUs"):
        resolve_device("cuda", 0, 3)
    with pytest.raises(DeviceError, match="3 ranks on this host but 2 visible GPUs"):
        resolve_device("auto", 2, 3)
    assert issubclass(DeviceError, UserError)


def test_without_gpus_auto_is_the_cpu_and_cuda_an_error(gpus):
    gpus(0)
    assert resolve_device("auto", 0, 2) == torch.device("cpu")
    with pytest.raises(DeviceError, match="torch sees no CUDA device"):
        resolve_device("cuda")


def test_host_to_device_on_the_cpu_gives_the_tensors_back():
    tensors = [torch.arange(5), None, torch.ones(2, 3)]
    moved = HostToDevice(torch.device("cpu"))(tensors)
    assert moved[1] is None and torch.equal(moved[0], tensors[0]) and torch.equal(moved[2], tensors[2])


def test_numba_kernels_or_store_tables_on_cuda_are_config_errors(criteo_dataset, tmp_path):
    config = _config(criteo_dataset, tmp_path)
    with pytest.raises(ConfigError, match="train.kernels: numba kernels run on the CPU"):
        dataclasses.replace(config.train, device="cuda", kernels="numba").validate()
    raw = config.to_dict()
    raw["train"]["device"] = "cuda"
    raw["embedding_store"]["tables"] = {"t_C1": 0.5}
    with pytest.raises(ConfigError, match="embedding_store.tables: store-backed tables train on the CPU only"):
        TrainConfig.from_dict(raw)


def test_the_planner_never_puts_a_table_on_the_store_of_a_cuda_run(criteo_dataset, tmp_path):
    config = _config(criteo_dataset, tmp_path)
    assert config.embedding_store.cache_fraction > 0
    on_gpu = for_job(config, DistributedContext(device=torch.device("cuda", 0)))
    assert on_gpu.embedding_store.cache_fraction == 0.0
    assert for_job(config, DistributedContext()) == config


def test_train_and_evaluate_from_python_honour_train_device(criteo_dataset, tmp_path, gpus):
    gpus(0)
    with pytest.raises(DeviceError, match="no CUDA device"):
        train(_config(criteo_dataset, tmp_path / "run", device="cuda", kernels="torch"))
    train(_config(criteo_dataset, tmp_path / "run", max_steps=2))  # the failed start left no run behind
    on_cuda = _config(criteo_dataset, tmp_path / "run", device="cuda", kernels="torch")
    with pytest.raises(DeviceError, match="no CUDA device"):
        evaluate_checkpoint(tmp_path / "run", on_cuda)


def test_dense_state_is_restored_onto_the_runs_device(criteo_dataset, tmp_path):
    train(_config(criteo_dataset, tmp_path / "run", max_steps=2))
    restorable = checkpoint.open_checkpoint(tmp_path / "run" / "checkpoint")
    dense = load_dense(restorable, "meta")
    assert all(t.device.type == "meta" for t in dense["bottom"].values())
