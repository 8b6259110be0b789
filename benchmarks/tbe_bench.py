"""Embedding train step (forward, backward through a fixed upstream gradient, the optimizer
update): our fused module against FBGEMM's table-batched embedding on the CPU
(``SplitTableBatchedEmbeddingBagsCodegen``, what TorchRec runs), like with like, in one
process on the same ids, from the same weights, interleaved:

- row-wise Adagrad, fp32 and fp16 weights: ours against FBGEMM's ``EXACT_ROWWISE_ADAGRAD``
  (both fp32 runs must end with the same weights, to fp32 rounding, or no ratio is given);
- element-wise Adagrad: ours against FBGEMM's ``EXACT_ADAGRAD`` and against
  ``nn.EmbeddingBag`` with ``torch.optim.Adagrad``;
- SGD: ours against FBGEMM's ``EXACT_SGD``; Adam: ours alone (FBGEMM has no CPU Adam).

Beside them, the machine's memory-bound limit for the step: a random gather of as many rows
from huge-page memory of the tables' size (the rows a step must read), and our fraction of
it; and where our step's time goes (forward, backward with the update). Our modules run
with the default id check (``bounds_check="fatal"``: on the CPU, the lookup kernel's own).
``threads``: 0 for all cores, 1 for the per-core comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from neorec.benchmarks.baselines import EmbeddingBagCollectionReference, FbgemmTableBatched, fbgemm_missing
from neorec.benchmarks.timing import interleaved_rates
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.embedding.memory import huge_page_empty
from neorec.trainer.run.step import set_threads

LEARNING_RATE = 0.01
EPS = 1e-8
WEIGHT_TOLERANCE = 1e-4
"""Largest weight difference allowed between ours and FBGEMM after the timed steps (fp32)."""


@dataclass(frozen=True)
class TBEConfig:
    name: str
    num_tables: int
    rows: int
    dim: int
    ids_per_bag: int
    batch_size: int


CONFIGS = (
    TBEConfig("criteo-like", 26, 100_000, 64, 1, 4096),
    TBEConfig("multi-hot", 8, 1_000_000, 64, 20, 1024),
)
QUICK_CONFIGS = (
    TBEConfig("criteo-like-quick", 4, 10_000, 64, 1, 1024),
    TBEConfig("multi-hot-quick", 2, 50_000, 64, 20, 256),
)
NUM_BATCHES = 8

Step = Callable[[int], int]


def run(quick: bool = False, threads: int = 0) -> dict[str, Any]:
    threads = set_threads(threads)
    steps, rounds = (3, 2) if quick else (10, 7)
    missing = fbgemm_missing()
    results = [_run_config(c, steps, rounds, missing is None) for c in (QUICK_CONFIGS if quick else CONFIGS)]
    return {"benchmark": "tbe", "threads": threads, "fbgemm": missing or "fbgemm-gpu-cpu (CPU kernels)",
            "configs": results}


def _zipf_batches(config: TBEConfig, seed: int = 0) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    keys = tuple(f"f{i}" for i in range(config.num_tables))
    ids_per_batch = config.num_tables * config.batch_size * config.ids_per_bag
    lengths = torch.full((config.num_tables * config.batch_size,), config.ids_per_bag, dtype=torch.int32)
    return [KeyedJaggedTensor(keys, lengths, torch.from_numpy(rng.zipf(1.1, ids_per_batch) % config.rows))
            for _ in range(NUM_BATCHES)]


class _Setup:
    """One config's tables, ids, upstream gradient and starting weights."""

    def __init__(self, config: TBEConfig) -> None:
        self.config = config
        self.tables = [TableConfig(f"t{i}", config.rows, config.dim, (f"f{i}",)) for i in range(config.num_tables)]
        self.batches = _zipf_batches(config)
        self.ids_per_step = int(self.batches[0].values.numel())
        self.upstream = torch.randn(config.batch_size, config.num_tables * config.dim,
                                    generator=torch.Generator().manual_seed(1))

    def ours(self, optimizer: str, weight_dtype: str = "fp32",
             bounds_check: str = "fatal") -> FusedEmbeddingBagCollection:
        return FusedEmbeddingBagCollection(self.tables, SparseOptimizer(optimizer, LEARNING_RATE, eps=EPS), seed=0,
                                           weight_dtype=weight_dtype, bounds_check=bounds_check)

    def weights(self, module: FusedEmbeddingBagCollection) -> list[torch.Tensor]:
        return [module.table_weight(t.name).float() for t in self.tables]

    def step(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Step:
        def run(i: int) -> int:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            module(self.batches[i % NUM_BATCHES]).backward(self.upstream)
            if optimizer is not None:
                optimizer.step()
            return self.config.batch_size
        return run

    def forward(self, module: torch.nn.Module) -> Step:
        def run(i: int) -> int:
            with torch.no_grad():
                module(self.batches[i % NUM_BATCHES])
            return self.config.batch_size
        return run


def _run_config(config: TBEConfig, steps: int, rounds: int, with_fbgemm: bool) -> dict[str, Any]:
    setup = _Setup(config)
    out: dict[str, Any] = {"config": config.__dict__}
    out["rowwise_adagrad"] = _rowwise(setup, steps, rounds, with_fbgemm)
    out["adagrad"] = _against_fbgemm(setup, "adagrad", steps, rounds, with_fbgemm, with_torch=True)
    out["sgd"] = _against_fbgemm(setup, "sgd", steps, rounds, with_fbgemm)
    out["adam"] = _against_fbgemm(setup, "adam", steps, rounds, False)
    return out


def _rowwise(setup: _Setup, steps: int, rounds: int, with_fbgemm: bool) -> dict[str, Any]:
    """Row-wise Adagrad, fp32 and fp16, ours and FBGEMM's; the memory limit; our phases."""
    config = setup.config
    ours = {dtype: setup.ours("rowwise_adagrad", dtype) for dtype in ("fp32", "fp16")}
    start = setup.weights(ours["fp32"])
    candidates = {f"ours_{d}": setup.step(m) for d, m in ours.items()}
    theirs = {}
    if with_fbgemm:
        theirs = {dtype: FbgemmTableBatched(setup.tables, start, "rowwise_adagrad", LEARNING_RATE, EPS, dtype)
                  for dtype in ("fp32", "fp16")}
        candidates.update({f"fbgemm_{d}": setup.step(m) for d, m in theirs.items()})
    matrix = huge_page_empty(config.num_tables * config.rows * config.dim, torch.float32).view(-1, config.dim)
    matrix.uniform_()  # real pages, not the zero page
    random_rows = [torch.randint(0, matrix.shape[0], (setup.ids_per_step,), generator=torch.Generator().manual_seed(i))
                   for i in range(NUM_BATCHES)]

    gathered = torch.empty(setup.ids_per_step, config.dim)  # reused: the limit counts memory traffic, not page faults

    def gather(i: int) -> int:
        torch.index_select(matrix, 0, random_rows[i % NUM_BATCHES], out=gathered)
        return config.batch_size

    candidates["gather_bound"] = gather
    candidates["ours_fp32_forward"] = setup.forward(ours["fp32"])
    rates = interleaved_rates(candidates, steps, rounds)
    step_ms = 1e3 * config.batch_size / rates["ours_fp32"]
    forward_ms = 1e3 * config.batch_size / rates["ours_fp32_forward"]
    result: dict[str, Any] = {
        "samples_per_s": {k: v for k, v in rates.items() if k != "ours_fp32_forward"},
        "memory_limit_samples_per_s": rates["gather_bound"],
        "ours_fraction_of_memory_limit": rates["ours_fp32"] / rates["gather_bound"],
        "ours_phases_ms": {"step": step_ms, "forward": forward_ms, "backward_and_update": step_ms - forward_ms},
    }
    if theirs:
        difference = max(float((a - b).abs().max()) for a, b in zip(setup.weights(ours["fp32"]),
                                                                    theirs["fp32"].table_weights()))
        result["max_weight_difference_fp32"] = difference
        if difference > WEIGHT_TOLERANCE:
            raise RuntimeError(f"{config.name}: ours and FBGEMM end {difference:g} apart after the same steps: the "
                               f"comparison is not like with like")
        result["ours_over_fbgemm"] = {d: rates[f"ours_{d}"] / rates[f"fbgemm_{d}"] for d in ("fp32", "fp16")}
    return result


def _against_fbgemm(setup: _Setup, optimizer: str, steps: int, rounds: int, with_fbgemm: bool,
                    with_torch: bool = False) -> dict[str, Any]:
    """Ours with ``optimizer`` against FBGEMM's (and, ``with_torch``, nn.EmbeddingBag with
    the torch.optim equivalent), fp32."""
    ours = setup.ours(optimizer)
    candidates = {"ours": setup.step(ours)}
    if with_fbgemm:
        theirs = FbgemmTableBatched(setup.tables, setup.weights(ours), optimizer, LEARNING_RATE, EPS)
        candidates["fbgemm"] = setup.step(theirs)
    if with_torch:
        naive = EmbeddingBagCollectionReference(setup.tables, setup.weights(ours))
        candidates["torch"] = setup.step(naive, torch.optim.Adagrad(naive.parameters(), lr=LEARNING_RATE, eps=EPS))
    rates = interleaved_rates(candidates, steps, rounds)
    return {"samples_per_s": rates, **{f"ours_over_{k}": rates["ours"] / v for k, v in rates.items() if k != "ours"}}
