import numpy as np
import torch

from tests.trainer.reference import random_kjt
from trainer.batch import Batch
from trainer.embedding_config import SparseOptimizer, TableConfig
from trainer.embedding_reference import EmbeddingBagCollectionReference
from trainer.fused_embedding import FusedEmbeddingBagCollection
from trainer.model import DLRM


def _models():
    tables = [TableConfig(f"t{i}", 30 + i, 8, (f"f{i}",)) for i in range(4)]
    fused = FusedEmbeddingBagCollection(tables, SparseOptimizer("sgd", 0.5), seed=1)
    reference = EmbeddingBagCollectionReference(tables, [fused.table_weight(t.name).clone() for t in tables])
    make = lambda emb: DLRM(num_dense=5, num_sparse=4, embedding_dim=8, bottom_mlp=[16], top_mlp=[32, 16],
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
        torch.testing.assert_close(ours.embeddings.table_weight(t.name), ref.embeddings.bags[t.name].weight.detach(),
                                   rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.dense_parameters(), ref.dense_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_interaction_shape():
    _, ours, _ = _models()
    kjt = random_kjt(ours.embeddings.tables, 3, np.random.default_rng(1))
    batch = Batch(dense=torch.zeros(3, 5), sparse=kjt, labels=torch.zeros(3), num_valid=3)
    assert ours(batch).shape == (3,)
    assert ours.interaction.output_dim_extra == 10  # 5 vectors -> 10 pairs
