"""Bad input, as a hostile or careless user gives it, is refused by name: one line on
stderr, exit status 2, no traceback, and nothing lost."""

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import replace

import pytest

from neorec.common.errors import ConfigError
from neorec.common.dir_lock import DirectoryInUseError
from neorec.trainer.distributed import SINGLE_PROCESS
from neorec.trainer.planner.from_config import plan_for_config
from neorec.trainer.run.loop import TrainingRun
from neorec.trainer.run.run_dir import METRICS
from neorec.trainer.run.train import train
from tests.trainer.test_train import _config
from tests.cli import NEOREC, neorec

ERROR = 2


def _refused(result, *texts):
    assert result.returncode == ERROR, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    line = [x for x in result.stderr.splitlines() if x.startswith("neorec: error:") or "error:" in x]
    assert line, result.stderr
    for text in texts:
        assert text in result.stderr, (text, result.stderr)


def _train(data, run, *more):
    return neorec("train", "configs/demo.toml", "--set", f"data.path='{data}'", "--set", f"run.dir='{run}'",
                  "--set", "train.batch_size=256", "--set", "model.max_table_rows=1000", *more)


@pytest.fixture
def dataset_copy(criteo_dataset, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(criteo_dataset.root, copy)
    return copy


@pytest.mark.parametrize("damage,expected", [
    (lambda obj: "{not json", "not a readable JSON file"),
    (lambda obj: {k: v for k, v in obj.items() if k != "schema"}, "lacks 'schema'"),
    (lambda obj: {**obj, "format": "other/9"}, "unknown format 'other/9'"),
    (lambda obj: {**obj, "schema": {**obj["schema"], "sparse": [{**obj["schema"]["sparse"][0], "cardinality": "big"}]}},
     "cardinality must be a positive integer"),
    (lambda obj: {**obj, "schema": {**obj["schema"], "sparse": []}}, "a DLRM needs at least one sparse"),
    (lambda obj: {**obj, "oracle": {**obj["oracle"], "eval_auc": "x"}}, "'oracle' must be an object of numbers"),
    (lambda obj: "[" * 100_000, "not a readable JSON file: maximum recursion depth"),
])
def test_a_bad_dataset_json_is_named(dataset_copy, tmp_path, damage, expected):
    path = dataset_copy / "dataset.json"
    changed = damage(json.loads(path.read_text()))
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    _refused(_train(dataset_copy, tmp_path / "run"), str(path), expected)


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_unknown_splits_and_bad_values_are_named(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    _refused(_train(criteo_dataset.root, run, "--set", "data.eval_split='test'"), "has no split 'test'")
    _refused(_train(criteo_dataset.root, run, "--set", "optimizer.sparse_lr=nan"),
             "optimizer.sparse_lr: expected a finite number")
    _refused(_train(criteo_dataset.root, run, "--set", "data.ingest_stall_timeout_s=inf"),
             "data.ingest_stall_timeout_s: expected a finite number")
    _refused(_train(criteo_dataset.root, run, "--set", "optimizer.sparse_eps=-1e-8"), "optimizer.sparse_eps")
    _refused(_train(criteo_dataset.root, run, "--set", "optimizer.sparse_weight_decay=-0.1"),
             "optimizer.sparse_weight_decay")
    for decay in ("0", "1.5"):
        _refused(_train(criteo_dataset.root, run, "--set", f"optimizer.sparse_adagrad_decay={decay}"),
                 "optimizer.sparse_adagrad_decay: must lie in (0, 1]")
    _refused(_train(criteo_dataset.root, run, "--set", "run.dir=''"), "run.dir: must name a directory")
    _refused(_train(criteo_dataset.root, run, "--set", "train.seed=2024-01-01"), "as a date")
    _refused(_train(criteo_dataset.root, run, "--set", "train.batch_size=100000"), "fewer than one step")
    assert not run.exists()


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_bad_command_line_values_are_refused():
    for args in (["data", "synth", "--rows", "-5", "--out", "x"], ["ingest", "serve", "--grace", "-1"],
                 ["ingest", "serve", "--grace", "nan"], ["ingest", "serve", "--worker-threads", "0"],
                 ["ingest", "serve", "--row-group-cache-mib", "-1"], ["ingest", "serve", "--max-streams", "0"],
                 ["train", "configs/demo.toml", "--nproc", "0"],
                 ["data", "synth", "--rows", "3", "--partitions", "5", "--out", "x"],
                 ["data", "synth", "--rows", "100", "--eval-fraction", "0", "--out", "x"],
                 ["plan", "configs/demo.toml", "--world-size", "0"],
                 ["store", "serve", "--dir", "README.md/store"]):
        result = neorec(*args)
        assert result.returncode == ERROR and "Traceback" not in result.stderr, (args, result.stderr)


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_a_run_directory_holds_one_run(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    assert _train(criteo_dataset.root, run).returncode == 0
    first = (run / METRICS).read_text()
    _refused(_train(criteo_dataset.root, run), "already holds a run", "--overwrite")
    assert (run / METRICS).read_text() == first  # nothing lost
    _refused(_train(criteo_dataset.root, run, "--overwrite", "--set", "embedding_store.tables={t_nope=0.5}"),
             "t_nope")  # the planner refuses the new run: the old one is not removed for it
    assert (run / METRICS).read_text() == first
    (run / "notes.txt").write_text("mine")
    result = _train(criteo_dataset.root, run, "--set", "train.seed=1", "--overwrite")
    assert result.returncode == 0, result.stderr
    assert json.loads((run / "config.json").read_text())["train"]["seed"] == 1
    assert (run / "notes.txt").read_text() == "mine"  # only the run's own files are replaced


def test_overwrite_removes_a_linked_run_file_as_a_link_and_nothing_it_points_to(tmp_path):
    """A run's checkpoints may live elsewhere behind a symbolic link: ``--overwrite``
    removes the link, not the files outside the run directory it points to."""
    from neorec.trainer.run.run_dir import CHECKPOINTS, CONFIG, RunDirError, claim

    elsewhere = tmp_path / "big-disk" / "checkpoints"
    elsewhere.mkdir(parents=True)
    (elsewhere / "kept").write_text("not the run's to remove")
    run = tmp_path / "run"
    run.mkdir()
    (run / CHECKPOINTS).symlink_to(elsewhere)
    (run / CONFIG).write_text("{}")
    assert claim(run, overwrite=True) == run
    assert not (run / CHECKPOINTS).exists() and not (run / CHECKPOINTS).is_symlink()
    assert not (run / CONFIG).exists()
    assert (elsewhere / "kept").read_text() == "not the run's to remove"
    (run / CHECKPOINTS).symlink_to(tmp_path / "nowhere")  # a dangling link is a run file too
    with pytest.raises(RunDirError, match="already holds a run"):
        claim(run)


def test_a_run_without_a_complete_checkpoint_is_not_offered_to_resume(tmp_path):
    """A run killed before its first checkpoint: --resume would be refused, so the refusal
    of a new run there does not offer it."""
    from neorec.trainer.run.run_dir import CHECKPOINTS, CONFIG, RunDirError, check_claim

    run = tmp_path / "run"
    (run / CHECKPOINTS / "step-000000005").mkdir(parents=True)  # written, never committed (no manifest)
    (run / CONFIG).write_text("{}")
    with pytest.raises(RunDirError, match=r"\(config.json, checkpoint\); it holds no complete checkpoint to resume "
                                          r"from: pass --overwrite to replace it, or choose another run.dir$"):
        check_claim(run)
    (run / CHECKPOINTS / "step-000000005" / "manifest.json").write_text("{}")
    with pytest.raises(RunDirError, match=r"pass --overwrite to replace it, --resume to continue it, or choose"):
        check_claim(run)


def test_an_unwritable_run_directory_is_found_before_training(criteo_dataset, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    _refused(_train(criteo_dataset.root, blocker), f"run directory {blocker} is a file")
    _refused(_train(criteo_dataset.root, blocker / "run"),
             f"run directory {blocker / 'run'} cannot be made: {blocker} is a file, not a directory")


def test_a_full_disk_ends_training_with_the_file_named(criteo_dataset, tmp_path, monkeypatch):
    import errno

    from neorec.trainer.checkpoint import writer as writer_module
    from neorec.trainer.run.run_dir import RunDirError

    class Full:
        """A file on a disk that fills up: opening works, and the first write, the second
        does not."""

        def __init__(self, path, mode):
            self.file = open(path, mode)
            self.writes = 0

        def write(self, data):
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.file.write(data)
            self.file.flush()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(writer_module, "open", Full, raising=False)
    with pytest.raises(RunDirError, match=r"cannot write checkpoint .*rank-00000.emb: no space left on device"):
        train(_config(criteo_dataset, tmp_path / "run"))
    partial = [p for p in (tmp_path / "run" / "checkpoint").rglob("*") if p.is_file()]
    assert partial == []  # the failed checkpoint's part-written file holds no space


def test_ctrl_c_stops_training_with_one_line_and_status_130(demo_kernels, tmp_path):
    data = tmp_path / "data"
    assert neorec("data", "synth", "--rows", "60000", "--out", str(data)).returncode == 0
    process = subprocess.Popen(
        [*NEOREC, "train", "configs/demo.toml", "--set", f"data.path='{data}'",
         "--set", f"run.dir='{tmp_path / 'run'}'", "--set", "train.epochs=50", "--set", "train.batch_size=64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / METRICS).exists() or not (tmp_path / "run" / METRICS).read_text():
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "neorec: interrupted" in stderr and "Traceback" not in stderr


def test_an_unknown_table_in_sharding_tables_is_refused_on_one_rank_as_on_several(criteo_dataset, tmp_path):
    config = _config(criteo_dataset, tmp_path / "run")
    config = replace(config, sharding=replace(config.sharding, tables={"t_nope": "row_wise"}))
    expected = r"^sharding.tables.t_nope: the dataset has no table 't_nope' \(it has t_C1, t_C10, "
    with pytest.raises(ConfigError, match=expected):
        train(config)
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed
    with pytest.raises(ConfigError, match=expected):
        plan_for_config(criteo_dataset, config, 2)
    store = _config(criteo_dataset, tmp_path / "run")
    store = replace(store, embedding_store=replace(store.embedding_store, tables={"t_nope": 0.1}))
    with pytest.raises(ConfigError, match=r"^embedding_store.tables.t_nope: the dataset has no table 't_nope'"):
        train(store)


def test_a_run_directory_has_one_trainer_at_a_time(criteo_dataset, tmp_path):
    config = _config(criteo_dataset, tmp_path / "run")
    first = TrainingRun(config, SINGLE_PROCESS)  # set up: it holds the directory
    for overwrite, resume in ((True, False), (False, True)):
        with pytest.raises(DirectoryInUseError, match=f"run directory {tmp_path / 'run'} is in use by process "
                                                      f"{os.getpid()} \\(a trainer\\)"):
            train(config, overwrite=overwrite, resume=resume)
    assert (tmp_path / "run" / "config.json").is_file()  # the second trainer removed nothing
    first.run()  # released as it ends
    assert train(config, resume=True)["steps"] == first.state.global_step
