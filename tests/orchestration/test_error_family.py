"""User errors and bugs are told apart: an error that judges the user's input is one
``neorec: error:`` line and exit 2, with nothing drawn before it; anything else is a bug in
neorec and keeps its traceback (exit 1)."""

import json
import subprocess
import sys

import pytest

from neorec.common.errors import UserError
from tests.cli import NEOREC, neorec_in_process

PLANT_BUG = """
import sys
from neorec.trainer.run import loop

def broken_step(*args, **kwargs):
    raise ValueError("a planted bug inside training")

loop.train_step = broken_step
from neorec.orchestration.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _train_args(data, run, *more):
    return ["train", "configs/demo.toml", "--set", f"data.path='{data}'", "--set", f"run.dir='{run}'",
            "--set", "train.batch_size=256", "--set", "model.max_table_rows=1000", *more]


def _run(argv, timeout=300):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_a_bug_inside_training_keeps_its_traceback_and_exits_1(criteo_dataset, tmp_path):
    result = _run([sys.executable, "-c", PLANT_BUG, *_train_args(criteo_dataset.root, tmp_path / "run")])
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "ValueError: a planted bug inside training" in result.stderr
    assert "neorec: error:" not in result.stderr


def test_a_refused_train_prints_its_one_line_and_nothing_else(criteo_dataset, tmp_path):
    result = _run([*NEOREC,
                   *_train_args(criteo_dataset.root, tmp_path / "run", "--set", "train.batch_size=100000")])
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("neorec: error: split 'train'"), result.stderr


@pytest.mark.parametrize("make_path,expected", [
    (lambda tmp: tmp, "cannot read config file"),  # a directory where the config file should be
    (lambda tmp: tmp / "missing.toml", "not found"),
])
def test_an_unreadable_config_path_is_a_user_error(tmp_path, make_path, expected):
    result = _run([*NEOREC, "train", str(make_path(tmp_path))], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("neorec: error:") and expected in result.stderr


def test_unreadable_user_paths_are_named_not_tracebacks(tmp_path):
    result = neorec_in_process("checkpoint", "inspect", str(tmp_path / "none"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr  # not an empty listing
    assert f"{tmp_path / 'none'} is not a directory" in result.stderr
    (tmp_path / "empty").mkdir()
    result = neorec_in_process("checkpoint", "inspect", str(tmp_path / "empty"))
    assert result.returncode == 2 and f"{tmp_path / 'empty'}: no checkpoints" in result.stderr, result.stderr
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)  # a run that has written none yet: an empty listing
    for directory in (tmp_path / "run", tmp_path / "run" / "checkpoint"):
        result = neorec_in_process("checkpoint", "inspect", "--json", str(directory))
        assert result.returncode == 0 and json.loads(result.stdout)["checkpoints"] == [], result.stderr
    spec = tmp_path / "spec.toml"
    spec.mkdir()
    result = neorec_in_process("data", "import", str(spec), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot read import spec {spec}: Is a directory" in result.stderr
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"# caf\xe9\n[input]\n")
    result = neorec_in_process("data", "import", str(latin1), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{latin1}: not UTF-8 text (byte 5: b'\\xe9')" in result.stderr


@pytest.mark.parametrize("argv,expected,status", [
    (["train"], "neorec: error: train: the following arguments are required: config (see neorec train --help)", 2),
    (["train", "c.toml", "--nproc", "0"], "neorec: error: train: argument --nproc: must be at least 1, got 0", 2),
    (["ingest", "serve", "--port", "70000"], "neorec: error: ingest serve: argument --port: port 70000 is outside", 2),
    (["bogus"], "neorec: error: argument command: invalid choice: 'bogus'", 2),
    (["train", "c.toml", "--ingest", ""],
     "neorec: error: train: argument --ingest: give at least one reader service address, HOST:PORT,...", 2),
    (["train", "c.toml", "--ingest", "h:1,,h:2"],
     "neorec: error: train: argument --ingest: reader service address '' is not host:port", 2),
    (["eval", "--checkpoint", "r", "--ingest", "no-port"],
     "neorec: error: eval: argument --ingest: reader service address 'no-port' is not host:port", 2),
    (["status"], "neorec: error: status: the following arguments are required", 1),  # grpc_health_probe's 1
])
def test_bad_arguments_are_one_line_not_the_usage_block(argv, expected, status):
    result = neorec_in_process(*argv)
    assert result.returncode == status and result.stderr.startswith(expected), result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stdout == "", result.stderr


def test_the_errors_that_judge_input_are_one_family():
    from neorec.common.transport import EndpointError
    from neorec.embedding_store.client import StoreServiceError
    from neorec.embedding_store.segments import SegmentError
    from neorec.ingest.client import IngestError
    from neorec.ingest.errors import DataError, DatasetNotFoundError
    from neorec.ingest.import_spec import SpecError
    from neorec.orchestration.status import TargetError
    from neorec.trainer.checkpoint.layout import CheckpointError
    from neorec.trainer.config import ConfigError
    from neorec.trainer.embedding.store_backed import StoreError
    from neorec.trainer.run.run_dir import RunDirError
    from neorec.trainer.sharding.plan import PlanError

    for error in (ConfigError, DataError, DatasetNotFoundError, PlanError, CheckpointError, SpecError, RunDirError,
                  EndpointError, IngestError, StoreServiceError, SegmentError, StoreError, TargetError):
        assert issubclass(error, UserError), error
    assert not issubclass(ValueError, UserError) and not issubclass(OSError, UserError)


PLANT_LOG_LINES = """
import atexit, logging, sys
from neorec.orchestration.cli import main

atexit.register(lambda: logging.getLogger("torch._subclasses.fake_tensor").info("a library's INFO line"))
atexit.register(lambda: logging.getLogger("neorec.trainer").info("neorec's INFO line"))
sys.exit(main(sys.argv[1:]))
"""


def test_other_libraries_log_from_warning_and_neorec_from_info(criteo_dataset):
    """torch logs INFO lines at exit (after an interrupted import they reached the terminal)."""
    result = _run([sys.executable, "-c", PLANT_LOG_LINES, "data", "verify", str(criteo_dataset.root)], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "neorec's INFO line" in result.stderr and "a library's INFO line" not in result.stderr


@pytest.mark.parametrize("where,expected", [("dir", "is a directory, not a file"),
                                            ("missing/out.json", "missing is not a directory")])
def test_a_benchmark_s_json_path_is_checked_before_it_runs(tmp_path, where, expected):
    (tmp_path / "dir").mkdir()
    result = _run([*NEOREC, "bench", "store", "--json", str(tmp_path / where)], timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:]  # no benchmark ran
    assert result.stderr.strip() == f"neorec: error: {tmp_path / where}" + (
        f" {expected}" if where == "dir" else f": {tmp_path / expected}")


@pytest.mark.parametrize("services,said", [("[1, 2]", "not a job's services file"),
                                           ('{"ingest": [5]}', "not a job's services file"),
                                           ('{"ingest": "127.0.0.1:1"}', "not a job's services file"),
                                           ('{"ingest": []}', "lists no service")])
def test_a_job_s_services_file_of_another_shape_is_named(tmp_path, services, said):
    (tmp_path / "services.json").write_text(services)
    result = neorec_in_process("status", tmp_path)
    assert result.returncode == 1 and result.stderr.strip() == \
        f"neorec: error: {tmp_path / 'services.json'}: {said}" + (
            " (an object of roles, each a list of addresses)" if "shape" not in said and "file" in said else ""), \
        result.stderr


@pytest.mark.parametrize("content,said", [(b"\xff\xfe{}", "not a job's services file: 'utf-8' codec"),
                                          (b"{bad", "not a job's services file: Expecting"),
                                          (b'{"ingest": ["garbage address"]}', "garbage address")])
def test_a_job_s_services_file_that_is_no_json_or_names_no_address_is_a_bad_argument(tmp_path, content, said):
    (tmp_path / "services.json").write_bytes(content)
    result = neorec_in_process("status", tmp_path)
    assert result.returncode == 1 and result.stderr.startswith("neorec: error: ") and said in result.stderr, \
        result.stderr


def test_an_empty_rendezvous_id_is_refused():  # torchrun would draw one on each node: they would never meet
    result = neorec_in_process("train", "configs/demo.toml", "--nnodes", "2", "--rdzv", "127.0.0.1:1",
                               "--rdzv-id", "")
    assert result.returncode == 2 and "--rdzv-id: give the job an id" in result.stderr, result.stderr


@pytest.mark.parametrize("raised,restart_mends", [
    ("neorec.common.errors:ConfigError", False), ("neorec.ingest.errors:DataError", False),
    ("neorec.trainer.sharding.plan:PlanError", False),
    ("neorec.embedding_store.client:StoreServiceError", True), ("neorec.ingest.client:IngestError", True),
    ("neorec.embedding_store.segments:TierWriteError", True), ("neorec.common.dir_lock:DirectoryInUseError", True),
    ("neorec.trainer.checkpoint.layout:CheckpointError", True),  # a rank that died left a checkpoint unfinished
])
def test_elastic_restarts_start_the_ranks_again_unless_an_attempt_met_a_lasting_error(tmp_path, monkeypatch,
                                                                                      raised, restart_mends):
    """Under ``--max-restarts`` a rank that stopped with a config's or data's error leaves
    word, and the next attempt's ranks exit 2 at once; after a service that was down, a full
    disk or a lock, they start again. The word counts for later attempts only."""
    import importlib
    import types

    from neorec.orchestration import cli, processes

    module, name = raised.split(":")
    kind = getattr(importlib.import_module(module), name)
    assert issubclass(kind, UserError) and kind.lasting is not restart_mends
    error = kind(28, "no space left on device") if issubclass(kind, OSError) else kind("what went wrong")

    def fail(args):
        raise error

    parser = types.SimpleNamespace(parse_args=lambda argv: types.SimpleNamespace(run=fail))
    monkeypatch.setattr(cli, "_parser", lambda: parser)
    monkeypatch.setenv(processes.RANK_EXITS, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert cli.main([]) == 2
    assert processes.earlier_attempt_lasting_error() is None  # in the attempt that met it: its ranks run
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert processes.earlier_attempt_lasting_error() == (None if restart_mends else 1)


def test_a_refused_attempt_s_other_ranks_exit_after_local_rank_0_has_said_why(tmp_path, monkeypatch, capsys):
    """A rank of a refused attempt that exited before local rank 0 wrote its line would have
    torchrun stop the group, local rank 0 with it, its line unsaid: the node's other ranks
    wait for its word (at most a while: a local rank 0 that died leaves none)."""
    import threading
    import time

    from neorec.orchestration import cli, processes

    monkeypatch.setenv(processes.RANK_EXITS, str(tmp_path))
    (tmp_path / f"{processes.LASTING}0").write_text("0")  # rank 0's config error ended attempt 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    started = time.monotonic()
    processes.await_refusal_said(0.2)  # nobody said it: waits out the timeout
    assert time.monotonic() - started >= 0.2

    said_at: list[float] = []

    def local_rank_0_says_it() -> None:
        time.sleep(0.3)
        said_at.append(time.monotonic())
        processes.refusal_said()

    speaker = threading.Thread(target=local_rank_0_says_it)
    speaker.start()
    assert cli.main([]) == 2  # local rank 1: no line of its own, exits once rank 0's is out
    exited_at = time.monotonic()
    speaker.join()
    assert said_at and exited_at >= said_at[0]
    assert capsys.readouterr().err == ""

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    assert cli.main([]) == 2
    assert capsys.readouterr().err == ("neorec: error: not started again: rank 0 stopped with an error above that a "
                                       "restart cannot mend\n")
    assert (tmp_path / f"{processes.REFUSAL_SAID}2").exists()
