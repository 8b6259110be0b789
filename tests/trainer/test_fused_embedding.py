import numba
import numpy as np
import pytest
import torch

from tests.trainer.reference import ReferenceOptimizer, random_kjt, reference_pooled, touched_rows
from neorec.trainer.batch import KeyedJaggedTensor
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.embedding.kernels.forward import (LANES, MIN_LANES, pooled_forward, pooled_half_sum_lanes,
                                                        pooled_sum_lanes, streams_output)
from neorec.trainer.embedding.kernels.registers import STREAM_ALIGNMENT
from neorec.trainer.embedding.kernels.precision import BF16, FP16, FP32


def _tables(rng: np.random.Generator, pooling: str) -> list[TableConfig]:
    """Tables of different dims and sizes; one table is shared by two features. Pooling
    ``"mixed"``: these sum, and a fourth table of t0's dimension takes means."""
    each = "sum" if pooling == "mixed" else pooling
    tables = [
        TableConfig("t0", int(rng.integers(5, 40)), 8, ("a", "b"), pooling=each),
        TableConfig("t1", int(rng.integers(50, 200)), int(rng.choice([4, 16])), ("c",), pooling=each,
                    learning_rate=0.03),
        TableConfig("t2", 3, 5, ("d",), pooling=each),
    ]
    if pooling == "mixed":
        tables.append(TableConfig("t3", int(rng.integers(5, 40)), 8, ("e",), pooling="mean"))
    return tables


OPTIMIZERS = [
    SparseOptimizer("sgd", 0.1),
    SparseOptimizer("sgd", 0.1, weight_decay=0.01),
    SparseOptimizer("adagrad", 0.1, eps=1e-10),
    SparseOptimizer("adagrad", 0.1, eps=1e-10, adagrad_decay=0.8),
    SparseOptimizer("rowwise_adagrad", 0.1),
    SparseOptimizer("rowwise_adagrad", 0.1, adagrad_decay=0.8),
    SparseOptimizer("adam", 0.05, weight_decay=0.001),
]


HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": (1e-6, 1e-7), "fp16": (1e-3, 1e-6), "bf16": (8e-3, 1e-5)}
"""(rtol, atol) of the stored weights: about one unit in the last place of the storage;
a float32 rounding difference of the update can move a half value across a rounding
boundary."""


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: f"{o.kind}-wd{o.weight_decay}-decay{o.adagrad_decay}")
@pytest.mark.parametrize("pooling", ["sum", "mean", "mixed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_matches_pytorch_reference_over_steps(optimizer, pooling, weighted, seed, weight_dtype, kernels):
    """``kernels="torch"`` is the path a CUDA module takes, run here on CPU (on a GPU:
    ``tests/trainer/test_cuda.py``)."""
    train_against_reference(optimizer, pooling, weighted, seed, weight_dtype, kernels, torch.device("cpu"))


def train_against_reference(optimizer: SparseOptimizer, pooling: str, weighted: bool, seed: int, weight_dtype: str,
                            kernels: str, device: torch.device) -> None:
    """Three steps of a module on ``device`` against the reference on the CPU. The reference
    trains float32 copies and rounds them to the storage type after each update (to nearest
    even, as the module is told to)."""
    rng = np.random.default_rng(seed)
    tables = _tables(rng, pooling)
    module = FusedEmbeddingBagCollection(tables, optimizer, seed=seed, weight_dtype=weight_dtype,
                                         stochastic_rounding=False, kernels=kernels).to(device)
    weights = {t.name: module.table_weight(t.name).float().cpu().clone() for t in tables}  # not views of the module's
    reference = ReferenceOptimizer(tables, optimizer)
    rtol, atol = TOLERANCE[weight_dtype]
    for _ in range(3):
        kjt = random_kjt(tables, int(rng.integers(1, 12)), rng, weighted=weighted)
        out = module(kjt.to(device))
        assert out.device == module.weights.device
        leaves = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
        expected = reference_pooled(tables, leaves, kjt)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-7)
        upstream = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
        given = upstream.to(device, copy=True)
        out.backward(given)  # the update reads the upstream gradient, never writes it
        assert torch.equal(given.cpu(), upstream)
        (expected * upstream).sum().backward()
        reference.apply(weights, {n: leaves[n].grad for n in leaves}, touched_rows(tables, kjt))
        if weight_dtype in HALF:
            weights = {n: w.to(HALF[weight_dtype]).float() for n, w in weights.items()}
        for t in tables:
            stored = module.table_weight(t.name).float().cpu().clone()  # a copy: the reference updates in place
            torch.testing.assert_close(stored, weights[t.name], rtol=rtol, atol=atol)
            weights[t.name] = stored  # a value one ulp off would drift apart: continue from the module's


def test_adagrad_and_adam_match_torch_optimizers():
    rng = np.random.default_rng(5)
    tables = _tables(rng, "sum")
    tables[1] = TableConfig("t1", tables[1].num_embeddings, tables[1].embedding_dim, ("c",))
    for kind, make in (("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)),
                       ("adam", lambda p: torch.optim.SparseAdam(p, lr=0.05, eps=1e-8))):
        module = FusedEmbeddingBagCollection(tables, SparseOptimizer(kind, 0.1 if kind == "adagrad" else 0.05,
                                                                     eps=1e-10 if kind == "adagrad" else 1e-8))
        bags = {t.name: torch.nn.EmbeddingBag.from_pretrained(module.table_weight(t.name).clone(), freeze=False,
                                                              mode="sum", sparse=True) for t in tables}
        optimizer = make([b.weight for b in bags.values()])
        for _ in range(3):
            kjt = random_kjt(tables, 9, rng)
            out = module(kjt)
            expected = reference_pooled(tables, {n: b.weight for n, b in bags.items()}, kjt)
            upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            (out * upstream).sum().backward()
            optimizer.zero_grad()
            # functional embedding_bag gives dense grads; make them sparse as EmbeddingBag(sparse=True) would
            (expected * upstream).sum().backward()
            for b in bags.values():
                b.weight.grad = b.weight.grad.to_sparse()
            optimizer.step()
            for t in tables:
                torch.testing.assert_close(module.table_weight(t.name), bags[t.name].weight.detach(),
                                           rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
def test_bit_identical_with_one_and_two_threads(weight_dtype):
    """Stochastic rounding of bf16 updates included: its noise depends on the element and
    the step, not on the thread."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two cores")
    tables = [TableConfig("big", 500, 16, ("a", "b")), TableConfig("small", 20, 8, ("c",))]

    def run(threads: int) -> torch.Tensor:
        numba.set_num_threads(threads)
        rng = np.random.default_rng(9)
        module = FusedEmbeddingBagCollection(tables, SparseOptimizer("adam", 0.05), seed=2, weight_dtype=weight_dtype)
        for _ in range(4):
            kjt = random_kjt(tables, 256, rng, max_len=8, weighted=True)
            out = module(kjt)
            (out * torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))).sum().backward()
        return torch.cat([module.weights.float(), module.state1, module.state2])

    try:
        one, two = run(1), run(2)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert torch.equal(one, two)


@pytest.mark.parametrize("pooling", ["sum", "mixed"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_a_gradient_sliced_from_a_wider_one_updates_as_its_contiguous_copy(pooling, weighted, kernels):
    assert_a_sliced_gradient_updates_as_its_contiguous_copy(pooling, weighted, kernels, torch.device("cpu"))


def assert_a_sliced_gradient_updates_as_its_contiguous_copy(pooling: str, weighted: bool, kernels: str,
                                                           device: torch.device) -> None:
    """The interaction hands the embeddings their gradient as a slice of its vectors'
    wider one (the dense vector's D columns first), rows ``D + C`` floats apart: read in
    place, it updates every weight and state bit for bit as the same gradient copied to
    contiguous rows does."""
    rng = np.random.default_rng(4)
    tables = _tables(rng, pooling)
    sliced, copied = (FusedEmbeddingBagCollection(tables, SparseOptimizer("adam", 0.05), seed=1,
                                                  kernels=kernels).to(device) for _ in range(2))
    strides = []
    dense_dim = 3
    for _ in range(3):
        kjt = random_kjt(tables, 64, rng, max_len=5, weighted=weighted).to(device)
        out = sliced(kjt)
        out.register_hook(lambda grad: strides.append(grad.stride()))
        upstream = torch.from_numpy(rng.standard_normal((64, dense_dim + out.shape[1])).astype(np.float32)).to(device)
        dense = torch.zeros(64, dense_dim, device=device, requires_grad=True)
        (torch.cat([dense, out], dim=1) * upstream).sum().backward()
        (copied(kjt) * upstream[:, dense_dim:].contiguous()).sum().backward()
    assert strides == [(dense_dim + sliced.output_dim, 1)] * 3  # the slice reached the module uncopied
    for a, b in zip([sliced.weights, sliced.state1, sliced.state2], [copied.weights, copied.state1, copied.state2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16", "bf16"])
def test_wide_sums_pool_in_registers_like_the_general_kernel(monkeypatch, weight_dtype):
    """Tables whose width is a multiple of the register kernel's fewest lanes (64 or 16
    columns at a time) and unweighted sums take :func:`pooled_sum_lanes`, whatever the
    weights' precision; the same ids with unit weights take the general kernel. Outputs
    and three steps of training agree bit for bit, and with the reference; the register
    kernel streams its output (torch's buffers are aligned for it)."""
    from neorec.trainer.embedding import fused

    calls = []
    kernel = pooled_sum_lanes if weight_dtype == "fp32" else pooled_half_sum_lanes
    monkeypatch.setattr(fused, kernel.__name__, lambda *args: calls.append(args[-1]) or kernel(*args))
    tables = [TableConfig("wide", 50, 2 * LANES, ("a", "b")), TableConfig("narrow", 30, LANES, ("c",)),
              *(TableConfig(f"w{dim}", 20, dim, (f"f{dim}",)) for dim in (MIN_LANES, 2 * MIN_LANES, 3 * MIN_LANES, 96))]
    optimizer = SparseOptimizer("rowwise_adagrad", 0.1)
    in_registers = FusedEmbeddingBagCollection(tables, optimizer, seed=4, weight_dtype=weight_dtype)
    in_memory = FusedEmbeddingBagCollection(tables, optimizer, seed=4, weight_dtype=weight_dtype)
    rng = np.random.default_rng(5)
    for _ in range(3):
        kjt = random_kjt(tables, 64, rng, max_len=6)
        ones = KeyedJaggedTensor(kjt.keys, kjt.lengths, kjt.values, torch.ones(kjt.values.numel()))
        expected = reference_pooled(tables, {t.name: in_registers.table_weight(t.name).float() for t in tables}, kjt)
        out, general = in_registers(kjt), in_memory(ones)
        assert torch.equal(out, general)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
        upstream = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
        (out * upstream).sum().backward()
        (general * upstream).sum().backward()
        for t in tables:
            assert torch.equal(in_registers.table_weight(t.name), in_memory.table_weight(t.name))
    assert calls == [True] * 3


def _aligned_nans(n: int) -> np.ndarray:
    """float32 ``[n]`` of NaN starting on a :data:`STREAM_ALIGNMENT` boundary."""
    buffer = np.full(n + STREAM_ALIGNMENT // 4, np.nan, np.float32)
    start = (-buffer.ctypes.data % STREAM_ALIGNMENT) // 4
    return buffer[start : start + n]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dim", [MIN_LANES, 3 * MIN_LANES, 96, 2 * LANES])
@pytest.mark.parametrize("precision", [FP32, FP16, BF16])
def test_the_register_kernel_counts_out_of_range_ids_as_the_general_kernel_does(stream, dim, precision):
    """The kernels count out-of-range ids (the module's ``"fatal"`` check names one when
    they count any), each id once however many lanes its row spans, and pool the other ids
    alike, whether the register kernel stores its output through the caches or around
    them, from float32 rows or half-precision ones."""
    weights = np.random.default_rng(0).standard_normal(10 * dim).astype(np.float32)
    weights16 = np.zeros(0, np.uint16)
    if precision != FP32:
        half = torch.from_numpy(weights).to(torch.float16 if precision == FP16 else torch.bfloat16)
        weights16 = half.view(torch.int16).numpy().view(np.uint16)
        weights = half.float().numpy()  # the values the kernels decode
    stored = (weights, weights16) if precision == FP32 else (np.zeros(0, np.float32), weights16)
    i64 = lambda *v: np.array(v, dtype=np.int64)
    layout = (i64(0), i64(dim), i64(10), i64(0), i64(0), i64(0))  # offsets, dims, rows; feature: table, source, column
    bag_offsets, values = i64(0, 2, 3), i64(3, 10, -1)
    lanes_out, general_out = _aligned_nans(2 * dim), np.full(2 * dim, np.nan, np.float32)
    upstream = np.empty(3, np.int64), np.empty(3, np.int64)
    assert streams_output(lanes_out)
    pool = (lambda *args: pooled_sum_lanes(weights, *args)) if precision == FP32 else (
        lambda *args: pooled_half_sum_lanes(weights16, precision, *args))
    bad = pool(*layout, bag_offsets, values, 2, 1, lanes_out, upstream[0], stream)
    no_floats = np.zeros(0, np.float32)
    general_bad = pooled_forward(*stored, precision, *layout, np.zeros(1, np.bool_), bag_offsets, values, no_floats, 2,
                                 1, general_out, upstream[1], no_floats)
    assert bad == general_bad == 2
    assert np.array_equal(lanes_out, general_out) and np.array_equal(lanes_out[:dim], weights[3 * dim : 4 * dim])
    assert np.array_equal(upstream[0], upstream[1])


def _one_table_module_and_ids(ids: list[int]) -> tuple[FusedEmbeddingBagCollection, KeyedJaggedTensor]:
    """A 10-row table and a batch of one bag holding ``ids``."""
    module = FusedEmbeddingBagCollection([TableConfig("t", 10, 4, ("a",))], SparseOptimizer("sgd", 0.1))
    kjt = KeyedJaggedTensor(("a",), torch.tensor([len(ids)], dtype=torch.int32), torch.tensor(ids))
    return module, kjt


def test_touched_rows_and_eval_mode_do_not_update():
    module, kjt = _one_table_module_and_ids([3, 7])
    before = module.weights.clone()
    module.eval()
    module(kjt).sum()
    assert torch.equal(before, module.weights)
    module.train()
    module(kjt).sum().backward()
    assert module.table_touched("t").nonzero().flatten().tolist() == [3, 7]
    changed = (module.table_weight("t") != before.view(10, 4)).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 7]
    module.clear_touched()
    assert not module.table_touched("t").any()


def test_out_of_range_ids_raise():
    module, kjt = _one_table_module_and_ids([3, 10])
    with pytest.raises(IndexError, match=r"id 10 of feature 'a' is outside its table's rows t: \[0, 10\)"):
        module(kjt)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_rows_move_between_modules_with_their_optimizer_state(kind):
    """Rows read from one module and written into another continue training identically."""
    tables = [TableConfig("t", 40, 6, ("a", "b"))]
    rng = np.random.default_rng(3)
    source = FusedEmbeddingBagCollection(tables, SparseOptimizer(kind, 0.1), seed=1)
    for _ in range(2):
        source(random_kjt(tables, 8, rng)).sum().backward()
    target = FusedEmbeddingBagCollection(tables, SparseOptimizer(kind, 0.1), seed=2)
    target.optimizer_step.copy_(source.optimizer_step)
    rows = torch.randperm(40)[:25]
    weights, states = source.read_rows("t", rows)
    target.write_rows("t", rows, weights, states)
    assert torch.equal(target.table_weight("t")[rows], source.table_weight("t")[rows])
    kjt = random_kjt(tables, 8, rng)
    kjt.values = rows[kjt.values % 25]  # only rows that moved
    for module in (source, target):
        module(kjt).sum().backward()
    assert torch.equal(target.read_rows("t", rows)[0], source.read_rows("t", rows)[0])
    with pytest.raises(IndexError, match=r"\[0, 40\)"):
        source.read_rows("t", torch.tensor([40]))
    with pytest.raises(ValueError, match="distinct"):
        target.write_rows("t", torch.tensor([1, 1]), weights[:2], [s[:2] for s in states])


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16"])
def test_a_row_zeroer_zeroes_its_rows_of_every_table_and_nothing_else(kind, weight_dtype):
    tables = [TableConfig("a", 30, 4, ("x",)), TableConfig("b", 20, 8, ("y",)), TableConfig("c", 10, 2, ("z",))]
    module = FusedEmbeddingBagCollection(tables, SparseOptimizer(kind, 0.1), seed=4, weight_dtype=weight_dtype)
    rng = np.random.default_rng(5)
    for _ in range(3):  # optimizer states away from zero
        module(random_kjt(tables, 16, rng)).sum().backward()
    zero = module.row_zeroer({"b": np.array([19, 0, 7]), "a": np.array([3])})
    before = {t.name: module.read_rows(t.name, torch.arange(t.num_embeddings)) for t in tables}
    zero()
    for table in tables:
        weights, states = module.read_rows(table.name, torch.arange(table.num_embeddings))
        zeroed = {"a": [3], "b": [19, 0, 7]}.get(table.name, [])
        kept = [r for r in range(table.num_embeddings) if r not in zeroed]
        for now, then in zip([weights, *states], [before[table.name][0], *before[table.name][1]]):
            assert not now[zeroed].any()
            assert torch.equal(now[kept], then[kept])
    with pytest.raises(IndexError, match=r"'c'.*\[0, 10\)"):
        module.row_zeroer({"c": np.array([10])})


@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
def test_half_weights_take_half_the_memory_and_round_stochastically(weight_dtype):
    """Updates far below half an ulp: rounding to nearest never moves the weights, stochastic
    rounding moves them by the right amount on average."""
    tables = [TableConfig("t", 1, 4096, ("a",))]
    kjt = KeyedJaggedTensor(("a",), torch.tensor([1], dtype=torch.int32), torch.tensor([0]))
    start = torch.ones(1, 4096)
    steps, lr = 50, 1e-4  # each step moves a weight by 1e-4: ulp(1.0) is 2**-10 (fp16), 2**-7 (bf16)
    results = {}
    for stochastic in (False, True):
        module = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", lr), initial_weights=[start],
                                             weight_dtype=weight_dtype, stochastic_rounding=stochastic)
        assert module.weights.element_size() == 2 and module.weights.dtype == HALF[weight_dtype]
        for _ in range(steps):
            module(kjt).sum().backward()  # gradient 1 for every weight
        results[stochastic] = module.table_weight("t").float()
    assert torch.equal(results[False], start)
    mean = float(results[True].mean())
    assert abs(mean - (1 - steps * lr)) < 2e-4, mean
    weights, _ = module.read_rows("t", torch.tensor([0]))
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("batch_size", [16, 512])
def test_torch_ops_round_stochastically_like_the_numba_kernels(weight_dtype, batch_size):
    """Same noise, same rounding: SGD updates with stochastic rounding are bit-identical
    (at 512, the tables' ids are grouped by the radix sort)."""
    rng = np.random.default_rng(4)
    tables = _tables(rng, "sum")
    modules = [FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", 0.05), seed=3, weight_dtype=weight_dtype,
                                           kernels=k) for k in ("numba", "torch")]
    for _ in range(4):
        kjt = random_kjt(tables, batch_size, rng, weighted=True)
        upstream = torch.from_numpy(rng.standard_normal((batch_size, modules[0].output_dim)).astype(np.float32))
        outputs = [m(kjt) for m in modules]
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-6, atol=1e-7)
        for out in outputs:
            (out * upstream).sum().backward()
    assert torch.equal(modules[0].weights, modules[1].weights)
    assert torch.equal(modules[0].touched, modules[1].touched)


@pytest.mark.parametrize("make,message", [
    (lambda: SparseOptimizer("adam", beta1=1.0), "beta1 must lie in \\[0, 1\\), got 1.0"),
    (lambda: SparseOptimizer("adam", beta2=1.5), "beta2 must lie in \\[0, 1\\)"),
    (lambda: SparseOptimizer("sgd", learning_rate=float("nan")), "learning_rate must be a finite number > 0"),
    (lambda: SparseOptimizer("adagrad", eps=-1e-8), "eps must be a finite number > 0"),
    (lambda: SparseOptimizer("rowwise_adagrad", eps=0.0), "eps must be a finite number > 0"),
    (lambda: SparseOptimizer("sgd", eps=-1.0), "eps must be a finite number >= 0"),
    (lambda: SparseOptimizer("sgd", weight_decay=-0.1), "weight_decay must be a finite number >= 0"),
    (lambda: TableConfig("t", 10, 4, ("f",), learning_rate=-0.5), "table 't': learning_rate must be a finite"),
    (lambda: TableConfig("t", 10, 4, ("f",), learning_rate=0.0), "table 't': learning_rate must be a finite"),
    (lambda: TableConfig("t", 10, 4, "user"), "feature_names is a sequence of names, got the string 'user'"),
    (lambda: TableConfig("t", 10, 4.9, ("f",)), "embedding_dim must be a positive integer, got 4.9"),
    (lambda: TableConfig("t", True, 4, ("f",)), "num_embeddings must be a positive integer"),
    (lambda: TableConfig("", 10, 4, ("f",)), "name must be a non-empty string"),
])
def test_settings_that_would_fail_in_a_kernel_or_train_wrongly_are_refused_when_made(make, message):
    """Before, these were accepted: a bias correction divided by zero in the first update,
    a NaN or negative learning rate trained the loss upwards, a string's letters became
    four features, a float width was truncated."""
    with pytest.raises(ValueError, match=message):
        make()


def test_a_tables_feature_names_may_be_any_sequence():
    assert TableConfig("t", 10, 4, ["a", "b"]).feature_names == ("a", "b")


@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_per_id_weights_that_require_grad_get_the_gradient_embedding_bag_gives(kernels, weight_dtype):
    """A feature processor that learns per-id weights trains through their gradient (the
    rows as the forward read them, before the update), for tables of any width, both
    poolings, a table two features share, and a batch feature no table reads."""
    rng = np.random.default_rng(5)
    tables = [TableConfig("a", 50, 3, ("f1", "f2")), TableConfig("b", 30, 12, ("f3",), pooling="mean"),
              TableConfig("c", 20, 1, ("f4",))]
    module = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", learning_rate=0.5), seed=3,
                                         weight_dtype=weight_dtype, kernels=kernels)
    before = {t.name: module.table_weight(t.name).float().clone() for t in tables}
    for step in range(2):
        kjt = random_kjt(tables, 7, rng, weighted=True)
        extra = 6  # a feature of no table: its ids' weights get 0
        kjt = KeyedJaggedTensor((*kjt.keys, "unread"), torch.cat([kjt.lengths, torch.ones(7, dtype=torch.int32)]),
                                torch.cat([kjt.values, torch.arange(7) + extra]),
                                torch.cat([kjt.weights, torch.ones(7)]))
        learned = kjt.weights.clone().requires_grad_()
        upstream = torch.from_numpy(rng.standard_normal((7, module.output_dim)).astype(np.float32))
        (module(KeyedJaggedTensor(kjt.keys, kjt.lengths, kjt.values, learned)) * upstream).sum().backward()
        expected = kjt.weights.clone().requires_grad_()
        reference = reference_pooled(tables, before, KeyedJaggedTensor(kjt.keys, kjt.lengths, kjt.values, expected))
        (reference * upstream).sum().backward()
        assert torch.allclose(learned.grad, expected.grad, rtol=1e-5, atol=1e-6), (step, learned.grad, expected.grad)
        assert torch.equal(learned.grad[-7:], torch.zeros(7))
        assert not torch.equal(module.table_weight("a").float(), before["a"])  # the update still ran
        before = {t.name: module.table_weight(t.name).float().clone() for t in tables}


def test_the_state_dict_is_by_table_and_loads_only_into_the_same_tables():
    """Keyed as TorchRec keys an EmbeddingBagCollection's tables: tables in another order
    load by name; tables of other sizes are refused whole, nothing overwritten (the flat
    buffers alone, of the same total size, loaded into any module before)."""
    def made(tables, seed):
        return FusedEmbeddingBagCollection([TableConfig(*t) for t in tables], SparseOptimizer("adam"), seed=seed)

    user, item = ("user", 100, 8, ("u",)), ("item", 50, 16, ("i",))
    source = made([user, item], 1)
    source.optimizer_step.fill_(3)
    saved = source.state_dict()
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        "embedding_bags.user.weight": (100, 8), "embedding_bags.user.momentum1": (100, 8),
        "embedding_bags.user.momentum2": (100, 8), "embedding_bags.item.weight": (50, 16),
        "embedding_bags.item.momentum1": (50, 16), "embedding_bags.item.momentum2": (50, 16), "optimizer_step": ()}
    swapped = made([item, user], 2)
    swapped.load_state_dict(saved)
    for name in ("user", "item"):
        assert torch.equal(swapped.table_weight(name), source.table_weight(name))
    assert int(swapped.optimizer_step) == 3
    other = made([user, ("item", 60, 16, ("i",))], 3)
    before = other.weights.clone()
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags.item.weight.*\(50, 16\).*\(60, 16\)"):
        other.load_state_dict(saved)
    assert torch.equal(other.weights, before)
    torchrec_like = torch.nn.ModuleDict({"embedding_bags": torch.nn.ModuleDict(
        {"user": torch.nn.EmbeddingBag(100, 8), "item": torch.nn.EmbeddingBag(50, 16)})})
    loaded = made([user, item], 4)
    missing = loaded.load_state_dict(torchrec_like.state_dict(), strict=False).missing_keys
    assert sorted(missing) == sorted(k for k in saved if "momentum" in k or k == "optimizer_step")
    assert torch.equal(loaded.table_weight("item"), torchrec_like["embedding_bags"]["item"].weight.detach())
