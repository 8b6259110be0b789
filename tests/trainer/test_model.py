import numpy as np
import pytest
import torch

from tests.trainer.reference import ReferenceEmbeddings, random_kjt
from neorec.trainer.batch import Batch
from neorec.trainer.embedding.config import SparseOptimizer, TableConfig
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from neorec.trainer.model import DLRM


def _models():
    tables = [TableConfig(f"t{i}", 30 + i, 8, (f"f{i}",)) for i in range(4)]
    fused = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", 0.5), seed=1)
    reference = ReferenceEmbeddings(tables, {t.name: fused.table_weight(t.name) for t in tables})
    make = lambda emb: DLRM(num_dense=5, num_sparse=4, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[32, 16, 1],
                            embeddings=emb, seed=3)
    return tables, make(fused), make(reference)


def test_dlrm_with_fused_embeddings_equals_reference_through_training():
    tables, ours, ref = _models()
    ref_sparse = torch.optim.SGD(ref.embeddings.parameters(), lr=0.5)
    ours_dense = torch.optim.SGD(ours.dense_parameters(), lr=0.1)
    ref_dense = torch.optim.SGD(ref.dense_parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    for _ in range(4):
        kjt = random_kjt(tables, 16, rng)
        batch = Batch(dense=torch.from_numpy(rng.random((16, 5), dtype=np.float32)), sparse=kjt,
                      labels=torch.from_numpy(rng.integers(0, 2, 16).astype(np.float32)), num_valid=16)
        losses = []
        for model, optimizers in ((ours, [ours_dense]), (ref, [ref_dense, ref_sparse])):
            for o in optimizers:
                o.zero_grad()
            logits = model(batch)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            for o in optimizers:
                o.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-6
    for t in tables:
        torch.testing.assert_close(ours.embeddings.table_weight(t.name), ref.embeddings.weights[t.name].detach(),
                                   rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.dense_parameters(), ref.dense_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_interaction_shape():
    _, ours, _ = _models()
    kjt = random_kjt(ours.embeddings.tables, 3, np.random.default_rng(1))
    batch = Batch(dense=torch.zeros(3, 5), sparse=kjt, labels=torch.zeros(3), num_valid=3)
    assert ours(batch).shape == (3,)
    assert ours.interaction.output_dim_extra == 10  # 5 vectors -> 10 pairs


@pytest.mark.parametrize("num_sparse, dim", [(1, 4), (5, 3), (26, 16)])
def test_interaction_and_its_gradients_equal_autograds_of_the_plain_formula(num_sparse, dim):
    assert_interaction_equals_the_plain_formula(num_sparse, dim, torch.device("cpu"))


def assert_interaction_equals_the_plain_formula(num_sparse: int, dim: int, device: torch.device) -> None:
    """The dense output, then the dot products of every pair of vectors in the DLRM
    reference's order, the strictly lower triangle row by row; its gradients (computed as
    one product with the symmetric pair gradient) equal autograd's through ``bmm``."""
    from neorec.trainer.model import DotInteraction
    generator = torch.Generator().manual_seed(num_sparse)
    dense = torch.randn(7, dim, generator=generator).to(device).requires_grad_()
    pooled = torch.randn(7, num_sparse * dim, generator=generator).to(device).requires_grad_()
    upstream = torch.randn(7, dim + (num_sparse + 1) * num_sparse // 2, generator=generator).to(device)

    def plain(dense, pooled):
        vectors = torch.cat([dense.unsqueeze(1), pooled.view(7, num_sparse, dim)], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))
        rows, cols = zip(*[(i, j) for i in range(num_sparse + 1) for j in range(i)])
        return torch.cat([dense, products[:, list(rows), list(cols)]], dim=1)

    outputs, gradients = [], []
    for interaction in (DotInteraction(num_sparse).to(device), plain):
        out = interaction(dense, pooled)
        outputs.append(out.detach())
        gradients.append(torch.autograd.grad(out, (dense, pooled), upstream))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    for ours, theirs in zip(*gradients):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_the_interaction_takes_an_empty_batch_and_refuses_a_second_derivative():
    """A second derivative would silently be wrong (the backward's saved vectors are not a
    function of the inputs), so it is refused."""
    from neorec.trainer.model import DotInteraction
    interaction = DotInteraction(3)
    dense, pooled = torch.zeros(0, 4, requires_grad=True), torch.zeros(0, 12, requires_grad=True)
    out = interaction(dense, pooled)
    assert out.shape == (0, 4 + 6)
    out.sum().backward()
    assert pooled.grad.shape == (0, 12)
    dense, pooled = torch.randn(2, 4, requires_grad=True), torch.randn(2, 12, requires_grad=True)
    (grad,) = torch.autograd.grad(interaction(dense, pooled).pow(2).sum(), pooled, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        grad.sum().backward()


def _linear_shapes(mlp):
    return [(layer.in_features, layer.out_features) for layer in mlp if isinstance(layer, torch.nn.Linear)]


def test_mlp_sizes_are_the_whole_stack_as_torchrec_writes_them():
    tables = [TableConfig(f"t{i}", 30, 16, (f"f{i}",)) for i in range(4)]
    emb = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", 0.5))
    model = DLRM(num_dense=13, num_sparse=4, embedding_dim=16, bottom_mlp=[64, 16], top_mlp=[64, 32, 1],
                 embeddings=emb)
    assert _linear_shapes(model.bottom) == [(13, 64), (64, 16)]
    assert _linear_shapes(model.top) == [(16 + 10, 64), (64, 32), (32, 1)]
    assert isinstance(model.bottom[-1], torch.nn.ReLU) and isinstance(model.top[-1], torch.nn.Linear)
    with pytest.raises(ValueError, match="end with the embedding dimension 16"):
        DLRM(num_dense=13, num_sparse=4, embedding_dim=16, bottom_mlp=[64, 32], top_mlp=[1], embeddings=emb)
    with pytest.raises(ValueError, match="top MLP must end with one output"):
        DLRM(num_dense=13, num_sparse=4, embedding_dim=16, bottom_mlp=[16], top_mlp=[64, 32], embeddings=emb)


def test_uniform_init_is_pytorchs_default_and_deterministic_from_the_seed():
    from neorec.trainer.model import MLP

    def build(init, seed):
        return MLP([200, 50, 1], torch.Generator().manual_seed(seed), last_relu=False, init=init)

    a, b, other = build("uniform", 7), build("uniform", 7), build("uniform", 8)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a[0].weight, other[0].weight)
    bound = 1 / 200**0.5  # nn.Linear: kaiming_uniform(a=sqrt(5)) and the bias both give U(+-1/sqrt(fan_in))
    for tensor in (a[0].weight, a[0].bias):
        assert tensor.abs().max() <= bound and tensor.abs().max() > 0.9 * bound
    normal = build("normal", 7)
    assert normal[0].weight.abs().max() > bound  # a Gaussian's tails pass the uniform bound


@pytest.mark.parametrize("init", ["uniform", "normal"])
def test_a_model_of_no_dense_features_builds_without_a_warning(init, recwarn):
    """Avazu and MovieLens conversions have no dense columns: the bottom MLP's first layer
    has no inputs (torch warned that initialising its empty weight does nothing)."""
    from neorec.trainer.model import MLP

    mlp = MLP([0, 4, 2], torch.Generator().manual_seed(0), init=init)
    assert mlp[0].weight.shape == (4, 0) and not [str(w.message) for w in recwarn]


def test_a_feature_count_the_embeddings_do_not_pool_is_refused():
    """num_sparse below the embeddings' features made the interaction pair the wrong
    vectors (self-products among them) and train on, silently."""
    tables, _, _ = _models()  # four features of width 8
    fused = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", 0.5), seed=1)
    with pytest.raises(ValueError, match=r"the embeddings pool 32 columns, num_sparse \* embedding_dim is 2 \* 8 = 16"):
        DLRM(num_dense=5, num_sparse=2, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[1], embeddings=fused)
    from neorec.trainer.model import DotInteraction
    with pytest.raises(ValueError, match=r"pooled embeddings \[3, 2 features x 8\], got \[3, 32\]"):
        DotInteraction(2)(torch.zeros(3, 8), torch.zeros(3, 32))
