"""`neorec bench train`'s account of what the embeddings cost the anchor step."""

from __future__ import annotations

import pytest

from neorec.benchmarks.train_bench import embedding_cost


def test_the_embeddings_cost_is_read_off_the_three_steps_times():
    # batch 100: the dense-only step 100 ms, the whole step 125 ms, the embeddings alone 20 ms
    cost = embedding_cost(dlrm_qps=800.0, dense_only_qps=1000.0, embeddings_qps=5000.0, batch_size=100)
    assert cost["embeddings_alone_ms"] == pytest.approx(20.0)
    assert cost["embeddings_in_step_ms"] == pytest.approx(25.0)  # 5 ms of interference
    assert cost["fraction_at_standalone_cost"] == pytest.approx(100.0 / 120.0)


def test_overlap_shows_as_less_in_the_step_than_alone():
    cost = embedding_cost(dlrm_qps=950.0, dense_only_qps=1000.0, embeddings_qps=1000.0, batch_size=100)
    assert cost["embeddings_in_step_ms"] == pytest.approx(1e5 / 950.0 - 100.0)
    assert cost["embeddings_in_step_ms"] < cost["embeddings_alone_ms"] == pytest.approx(100.0)
    assert cost["fraction_at_standalone_cost"] == pytest.approx(0.5)
