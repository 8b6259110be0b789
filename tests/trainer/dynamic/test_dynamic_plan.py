"""The planner sizes a dynamic table by its capacity, counts its id map and sketch, and
``neorec plan`` explains it; a sharded run is refused (dynamic tables train in one process)."""

from __future__ import annotations

import pytest

from neorec.ingest.schema import Dataset
from neorec.ingest.synth import SynthSpec, generate
from neorec.trainer.config import ConfigError, TrainConfig
from neorec.trainer.embedding.dynamic.table import DynamicTable
from neorec.trainer.planner.from_config import plan_for_config
from neorec.trainer.run.build import build_model
from neorec.trainer.planner.render import render


@pytest.fixture(scope="module")
def raw_dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return generate(SynthSpec(rows=600, row_group_rows=300, seed=5, raw_ids=True, id_space=10**8),
                    tmp_path_factory.mktemp("raw"))


def test_dynamic_tables_are_planned_by_capacity_with_their_map(raw_dataset: Dataset) -> None:
    dynamic = {f.table: {"capacity": 1000 + i, "min_count": 2, "ttl": 5, "sketch_width": 4096}
               for i, f in enumerate(raw_dataset.schema.sparse)}
    config = TrainConfig.from_dict({"data": {"path": str(raw_dataset.root)},
                                    "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "dynamic": dynamic}})
    result = plan_for_config(raw_dataset, config, 2)
    specs = {t.name: t for t in result.tables}
    assert {name: spec.rows for name, spec in specs.items()} == {name: d["capacity"] + 1 for name, d in dynamic.items()}
    table = DynamicTable("t_C1", 0, 8, config.model.dynamic["t_C1"])
    assert specs["t_C1"].index_bytes == table.map.nbytes + table.sketch.counts.nbytes
    total_rows_bytes = sum(t.rows * t.row_bytes(t.dim) for t in result.tables)
    total_index = sum(t.index_bytes for t in result.tables)
    assert sum(result.memory) == pytest.approx(total_rows_bytes + total_index)
    with pytest.raises(ConfigError, match="dynamic tables train in one process"):
        build_model(raw_dataset, config, result.plan)
    text = render(result)
    assert "dynamic tables" in text
    assert "t_C1: capacity 1,000 rows, min_count 2, ttl 5 steps, LRU when full" in text
