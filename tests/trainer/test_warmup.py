"""After :func:`compile_kernels` of a run's config, the run compiles no Numba kernel: every
dispatcher it calls (embedding lookup and update of its weight storage and optimizer, the
store's cache, checkpoint quantization, hashing, Parquet decoding) was compiled before it
started, so the ranks of a multi-process run only load Numba's cache and never race to
write it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("warm_probe.py")


@pytest.mark.slow
@pytest.mark.parametrize("model, optimizer", [({"weight_dtype": "fp16"}, "rowwise_adagrad"),
                                              ({"weight_dtype": "bf16"}, "adam")])
def test_a_run_compiles_nothing_after_the_warm_up(criteo_dataset, tmp_path, model, optimizer):
    config = {
        "data": {"path": str(criteo_dataset.root)},
        "model": {"max_table_rows": 5000, "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [32, 1], **model},
        "optimizer": {"sparse": optimizer},
        "train": {"batch_size": 256, "eval_batch_size": 1000, "log_every": 5, "max_steps": 12},
        "checkpoint": {"every_steps": 5, "bits": 8},
        "embedding_store": {"tables": {"t_C1": 0.005, "t_C3": 0.02}},
        "run": {"dir": str(tmp_path / "run")},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}  # nothing compiled before
    result = subprocess.run([sys.executable, str(PROBE), str(tmp_path / "config.json")], capture_output=True,
                            text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["compiled_in_training"] == []
    for kernel in ("embedding.kernels.forward.pooled_forward", "embedding.kernels.forward.pooled_half_sum_lanes",
                   "embedding.kernels.backward.apply_updates",
                   "embedding.kernels.id_range.first_out_of_range",
                   "embedding_store.cache.lookup", "embedding_store.cache.admit", "checkpoint.quantize._quantize_rows",
                   "ingest.vocab._hash_strings", "embedding.kernels.routing.route_ids"):
        assert any(name.endswith(kernel) for name in report["warmed"]), kernel
