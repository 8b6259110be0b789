import itertools
import json

import numpy as np
import pytest

from neorec.trainer.run.run_dir import RunDirError
from neorec.ingest.metrics import auc, log_loss, normalized_entropy
from neorec.trainer.run.metrics import MetricsLog


def _pairwise_auc(y, s):
    pos = [si for yi, si in zip(y, s) if yi == 1]
    neg = [si for yi, si in zip(y, s) if yi == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(4))
def test_auc_equals_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 300)
    s = np.round(rng.random(300) + 0.3 * y, 1)  # rounding makes many ties
    assert auc(y, s) == pytest.approx(_pairwise_auc(y, s), abs=1e-12)


def test_logloss_and_ne():
    y = np.array([1, 0, 1, 1])
    p = np.array([0.9, 0.2, 0.6, 0.7])
    expected = -np.mean(np.log([0.9, 0.8, 0.6, 0.7]))
    assert log_loss(y, p) == pytest.approx(expected)
    base = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    assert normalized_entropy(y, p) == pytest.approx(expected / base)
    assert normalized_entropy(y, np.full(4, 0.75)) == pytest.approx(1.0)


def test_a_metrics_log_on_a_full_disk_names_its_file_once_and_closes():
    log = MetricsLog("/dev/full")  # every write: no space left on device
    with pytest.raises(RunDirError, match="cannot write /dev/full: no space left on device"):
        log.write({"step": 1})
    log.close()  # the record still buffered is not raised again (a cleanup must not mask the error)


@pytest.mark.parametrize("left", ["cut_in_a_line", "removed"])
def test_a_resumed_log_shorter_than_its_checkpoint_counted_goes_on_after_its_whole_lines(tmp_path, caplog, left):
    """A power loss (the log is not fsynced, the checkpoint is) or a person may leave the
    log shorter than the length the checkpoint kept: no padding, every line JSON."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(3):
        log.write({"step": step})
    counted = log.size()
    log.close()
    if left == "removed":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: counted - 3])
    resumed = MetricsLog(path, keep_bytes=counted)
    resumed.write({"step": 3})
    resumed.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == ([0, 1, 3] if left == "cut_in_a_line" else [3])
    assert f"the checkpoint counted: the records after its {2 if left == 'cut_in_a_line' else 0} whole lines are " \
           "lost" in caplog.text
