"""The CUDA path on a real GPU: the torch-op kernels against the reference and the Numba
kernels, run-to-run bit equality, a whole run with its checkpoint and evaluation, and a
run under torchrun on NCCL. Skipped where torch sees no CUDA device (as in CI); on a GPU
machine: ``pytest tests/trainer/test_cuda.py``."""

import json
import subprocess

import numpy as np
import pytest
import torch

from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.device import HostToDevice
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.run.train import evaluate_checkpoint, train
from neorec.orchestration.processes import torchrun_command
from tests.cli import neorec
from tests.trainer.reference import random_kjt
from tests.trainer.test_fused_embedding import (OPTIMIZERS, _tables, assert_a_sliced_gradient_updates_as_its_contiguous_copy,
                                                train_against_reference)
from tests.trainer.test_model import assert_interaction_equals_the_plain_formula
from tests.trainer.test_train import _config, final_state, untimed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: f"{o.kind}-wd{o.weight_decay}-decay{o.adagrad_decay}")
@pytest.mark.parametrize("pooling", ["sum", "mean", "mixed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16", "bf16"])
def test_torch_ops_on_cuda_match_the_reference_over_steps(optimizer, pooling, weighted, weight_dtype):
    train_against_reference(optimizer, pooling, weighted, 0, weight_dtype, "torch", CUDA)


@pytest.mark.parametrize("pooling", ["sum", "mixed"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cuda_update_reads_a_sliced_gradient_in_place_as_its_contiguous_copy(pooling, weighted):
    assert_a_sliced_gradient_updates_as_its_contiguous_copy(pooling, weighted, "torch", CUDA)


@pytest.mark.parametrize("num_sparse, dim", [(1, 4), (26, 16)])
def test_cuda_interaction_and_its_gradients_equal_the_plain_formula(num_sparse, dim):
    assert_interaction_equals_the_plain_formula(num_sparse, dim, CUDA)


def _train(tables: list[TableConfig], optimizer: SparseOptimizer, weight_dtype: str, kernels: str,
           device: torch.device, batch_size: int, steps: int = 4) -> FusedEmbeddingBagCollection:
    """A module trained ``steps`` steps with stochastic rounding on the same batches and
    upstream gradients wherever it runs."""
    rng = np.random.default_rng(11)
    module = FusedEmbeddingBagCollection(tables, optimizer, seed=3, weight_dtype=weight_dtype,
                                         kernels=kernels).to(device)
    for _ in range(steps):
        kjt = random_kjt(tables, batch_size, rng, max_len=8, weighted=True)
        out = module(kjt.to(device))
        upstream = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
        (out * upstream.to(device)).sum().backward()
    return module


def _state(module: FusedEmbeddingBagCollection) -> list[torch.Tensor]:
    return [t.cpu() for t in (module.weights, module.state1, module.state2, module.touched, module.optimizer_step)]


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
def test_cuda_steps_are_bit_identical_run_to_run(kind, weight_dtype):
    """Rows hit by many ids of one batch (the grouping's sort and the segment sums), bf16
    with stochastic rounding: floats are summed without atomics, so two runs agree bit for bit."""
    tables = _tables(np.random.default_rng(2), "sum")
    runs = [_state(_train(tables, SparseOptimizer(kind, 0.05), weight_dtype, "torch", CUDA, 512)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


STORAGE_EPS = {"fp32": torch.finfo(torch.float32).eps, "fp16": torch.finfo(torch.float16).eps,
               "bf16": torch.finfo(torch.bfloat16).eps}


def _close_at_scale(actual: torch.Tensor, expected: torch.Tensor, eps: float) -> None:
    """Every element within a few units of rounding at the tensor's own scale (an element
    near zero after a cancellation may differ there relatively much)."""
    actual, expected = actual.float().cpu(), expected.float()
    assert actual.shape == expected.shape
    if expected.numel():
        assert float((actual - expected).abs().max()) <= 4 * eps * float(expected.abs().max())


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16", "bf16"])
def test_cuda_torch_ops_train_like_the_numba_kernels(kind, weight_dtype):
    """The same batches through the Numba kernels on the CPU and the torch ops on the GPU:
    the same rows touched, the same optimizer steps, weights and states within rounding
    (the kernels sum a row's contributions in different orders, and a GPU contracts
    multiply-adds; stochastic rounding of a value one ulp off may round the other way)."""
    tables = _tables(np.random.default_rng(4), "sum")
    optimizer = SparseOptimizer(kind, 0.05)
    cpu = _train(tables, optimizer, weight_dtype, "numba", torch.device("cpu"), 512)
    gpu = _train(tables, optimizer, weight_dtype, "torch", CUDA, 512)
    assert torch.equal(cpu.touched, gpu.touched.cpu())
    assert torch.equal(cpu.optimizer_step, gpu.optimizer_step.cpu())
    _close_at_scale(gpu.weights, cpu.weights, STORAGE_EPS[weight_dtype])
    for ours, theirs in ((gpu.state1, cpu.state1), (gpu.state2, cpu.state2)):
        _close_at_scale(ours, theirs, STORAGE_EPS["fp32"])
    for table in tables:
        assert torch.equal(gpu.table_touched(table.name).cpu(), cpu.table_touched(table.name))


def test_out_of_range_ids_on_cuda_raise_naming_the_feature_before_any_update():
    """A training step's batch is refused when its update is due (the count of bad ids
    read after the event that marks its copy), an evaluation's at once."""
    module = FusedEmbeddingBagCollection([TableConfig("t", 10, 4, ("a",))], SparseOptimizer("sgd", 0.1)).to(CUDA)
    kjt = KeyedJaggedTensor(("a",), torch.tensor([2], dtype=torch.int32), torch.tensor([3, 10])).to(CUDA)
    before = [module.weights.clone(), module.optimizer_step.clone(), module.touched.clone()]
    match = r"id 10 of feature 'a' is outside its table's rows t: \[0, 10\)"
    with pytest.raises(IndexError, match=match):
        module(kjt).sum().backward()
    module.eval()
    with torch.no_grad(), pytest.raises(IndexError, match=match):
        module(kjt)
    for got, want in zip((module.weights, module.optimizer_step, module.touched), before):
        assert torch.equal(got, want)


def test_host_to_device_copies_land_on_the_gpu_unchanged():
    tensors = [torch.arange(1000), None, torch.randn(64, 13)]
    moved = HostToDevice(CUDA)(tensors)
    assert moved[1] is None and all(t.device == CUDA for t in (moved[0], moved[2]))
    assert torch.equal(moved[0].cpu(), tensors[0]) and torch.equal(moved[2].cpu(), tensors[2])


def test_a_whole_run_on_cuda_is_deterministic_restores_on_the_cpu_and_evaluates(criteo_dataset, tmp_path):
    """``train.device = "cuda"`` with the default kernels (torch ops there): two runs agree
    bit for bit; their checkpoint restores into a CPU model; its evaluation on the GPU
    gives the run's AUC; and the run learns what the same run on the CPU learns."""
    runs = [train(_config(criteo_dataset, tmp_path / f"gpu{i}", device="cuda", epochs=2)) for i in range(2)]
    a, b = final_state(tmp_path / "gpu0"), final_state(tmp_path / "gpu1")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert untimed(runs[0]) == untimed(runs[1])
    on_cuda = _config(criteo_dataset, tmp_path / "gpu0", device="cuda")
    assert evaluate_checkpoint(tmp_path / "gpu0", on_cuda)["auc"] == runs[0]["eval_auc"]
    on_cpu = train(_config(criteo_dataset, tmp_path / "cpu", device="cpu", kernels="torch", epochs=2))
    assert runs[0]["eval_auc"] == pytest.approx(on_cpu["eval_auc"], abs=2e-3)
    assert runs[0]["eval_auc"] > 0.6


def test_train_under_torchrun_on_the_gpu_and_more_ranks_than_gpus_named(criteo_dataset, tmp_path):
    """``neorec train`` as one rank under torchrun (an NCCL process group on the GPU), and
    ``--nproc`` above the GPU count refused in words. (Sharded collections need two GPUs:
    NCCL refuses two ranks on one.)"""
    run = tmp_path / "run"
    settings = ["--set", f"data.path='{criteo_dataset.root}'", "--set", "model.max_table_rows=2000",
                "--set", "train.batch_size=128", "--set", "train.device='cuda'"]
    command = torchrun_command(1, "neorec.orchestration.cli",
                               ["train", "configs/demo.toml", "--set", f"run.dir='{run}'", *settings])
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["eval_auc"] > 0.6
    gpus = torch.cuda.device_count()
    result = neorec("train", "configs/demo.toml", "--nproc", str(gpus + 1), "--set", f"run.dir='{tmp_path / 'x'}'",
                    *settings)
    assert result.returncode != 0
    assert f"{gpus + 1} ranks on this host but {gpus} visible GPUs" in result.stderr
