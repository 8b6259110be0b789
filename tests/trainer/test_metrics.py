import itertools

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
