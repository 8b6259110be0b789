"""``neorec plan`` and ``neorec train --nproc`` as a user runs them."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.trainer.test_train import final_state
from tests.cli import NEOREC, neorec, neorec_in_process

pytestmark = pytest.mark.usefixtures("demo_kernels")  # deadlines on first steps time training


@pytest.mark.slow  # two ranks end to end, ~14 s: CI runs it with -m slow
def test_train_with_two_processes_writes_a_checkpoint_one_process_restores(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    settings = ["--set", f"data.path='{criteo_dataset.root}'", "--set", "model.max_table_rows=2000",
                "--set", "train.batch_size=128", "--set", "sharding.tables={t_C1='row_wise'}"]
    result = neorec("train", "configs/demo.toml", "--nproc", "2", "--set", f"run.dir='{run}'", *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("eval AUC") == 1  # rank 0 reports
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["train_samples"] == summary["steps"] * 2 * 128
    plan = json.loads((run / "plan.json").read_text())
    assert {t["table"]: t["sharding_type"] for t in plan["tables"]}["t_C1"] == "row_wise"
    state = final_state(run)
    assert int(state["embeddings.optimizer_step"]) == summary["steps"]
    result = neorec("eval", "--checkpoint", str(run))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["auc"] == summary["eval_auc"]


def test_plan_prints_tables_and_ranks(criteo_dataset, tmp_path):
    out = tmp_path / "plan.json"
    result = neorec("plan", "configs/demo.toml", "--world-size", "4", "--ranks-per-node", "2",
                    "--set", f"data.path='{criteo_dataset.root}'", "--json", str(out))
    assert result.returncode == 0, result.stderr
    for table in range(1, 27):
        assert f"t_C{table} " in result.stdout
    assert "estimated step (slowest rank)" in result.stdout and "round-robin" in result.stdout
    assert json.loads(out.read_text())["world_size"] == 4


def test_an_impossible_plan_is_explained(criteo_dataset):
    result = neorec("plan", "configs/demo.toml", "--world-size", "2", "--memory-per-rank", "2MiB",
                    "--set", f"data.path='{criteo_dataset.root}'")
    assert result.returncode == 2
    assert "26 tables need" in result.stderr and "2 ranks x 2.00 MiB" in result.stderr
    assert "Options: more ranks or memory per rank" in result.stderr
    assert "Traceback" not in result.stderr


def _settings(dataset, run):
    return ["--set", f"data.path='{dataset.root}'", "--set", "model.max_table_rows=2000",
            "--set", "train.batch_size=128", "--set", f"run.dir='{run}'"]


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_the_gpu_code_path_trains_single_process_and_sharded_on_the_cpu(criteo_dataset, tmp_path):
    """``train.kernels = "torch"`` runs the lookups, updates and routing in torch ops, as on
    CUDA: the whole train loop, one process and two, on the CPU."""
    for nproc in ("1", "2"):
        run = tmp_path / f"run{nproc}"
        result = neorec("train", "configs/demo.toml", "--nproc", nproc, "--set", "train.kernels='torch'",
                        "--set", "train.device='cpu'", *_settings(criteo_dataset, run))
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["eval_auc"] > 0.6


def _parent(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == ancestor:
            return True
    return False


def _rank_processes(parent: int) -> dict[int, int]:
    """Trainer rank → pid, for the torchrun ranks under process ``parent``."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
            if "TORCHELASTIC_RUN_ID" in environ and _descends_from(int(proc.name), parent):
                ranks[int(environ["RANK"])] = int(proc.name)
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
    return ranks


@pytest.mark.slow
def test_a_frozen_rank_is_named_by_the_others_within_the_collective_timeout(criteo_dataset, tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [*NEOREC, "train", "configs/demo.toml", "--nproc", "2",
         "--set", "train.collective_timeout_s=8", "--set", "train.epochs=100", *_settings(criteo_dataset, run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        ranks = _rank_processes(process.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = process.communicate(timeout=180)
        assert process.returncode != 0
        assert "rank 1" in stderr and "went silent" in stderr, stderr[-3000:]
        assert time.monotonic() - stopped < 120
    finally:
        for pid in _rank_processes(process.pid).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if process.poll() is None:
            process.kill()


@pytest.mark.slow  # four runs, two of two processes
def test_another_rank_count_resumes_from_an_epoch_s_start_and_is_refused_inside_one(criteo_dataset, tmp_path):
    """Each rank reads its own share of an epoch's rows: a run resumed at an epoch's start on
    two processes trains every row of the next epoch once; inside an epoch it is refused."""
    run = tmp_path / "run"
    one = neorec("train", "configs/demo.toml", *_settings(criteo_dataset, run), "--set", "train.epochs=1")
    assert one.returncode == 0, one.stderr[-3000:]
    first = json.loads((run / "summary.json").read_text())
    two = neorec("train", "configs/demo.toml", "--nproc", "2", "--resume", str(run), *_settings(criteo_dataset, run),
                 "--set", "train.epochs=2")
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    rows = criteo_dataset.rows["train"]
    assert first["train_samples"] == rows // 128 * 128
    assert summary["train_samples"] == first["train_samples"] + rows // 256 * 256  # the second epoch, once

    inside = tmp_path / "inside"
    cut = neorec("train", "configs/demo.toml", *_settings(criteo_dataset, inside), "--set", "train.epochs=1",
                 "--set", "checkpoint.every_steps=10", "--set", "checkpoint.final=false")
    assert cut.returncode == 0, cut.stderr[-3000:]
    refused = neorec("train", "configs/demo.toml", "--nproc", "2", "--resume", str(inside),
                     *_settings(criteo_dataset, inside))
    assert refused.returncode != 0
    assert "made by 1 rank, 30 steps into its epoch (or partition), and this run has 2" in refused.stderr


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # two ranks, ~20 s
def test_nothing_outlives_a_sigkilled_command(criteo_dataset, tmp_path):
    """torchrun and the ranks stop when ``neorec train --nproc`` is killed outright (by a
    user, or by a launcher that was): they would hold the run directory and go on writing."""
    run = tmp_path / "run"
    process = subprocess.Popen(
        [*NEOREC, "train", "configs/demo.toml", "--nproc", "2",
         "--set", "train.epochs=100000", *_settings(criteo_dataset, run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        ranks = list(_rank_processes(process.pid).values())
        torchrun = {int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    for pid in ranks}
        assert len(ranks) == 2 and len(torchrun) == 1 and process.pid not in torchrun
        started = [*ranks, *torchrun]
        process.kill()
        process.wait()
        deadline = time.monotonic() + 45  # torchrun gives the ranks 30 s to stop on its SIGTERM
        while any(_running(pid) for pid in started):
            assert time.monotonic() < deadline, [pid for pid in started if _running(pid)]
            time.sleep(0.2)
    finally:
        process.kill()
        for pid in filter(_running, started):
            os.kill(pid, signal.SIGKILL)


def _torchrun_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir()
            if p.name.startswith(("torchelastic_", "neorec-torchrun-"))}


@pytest.mark.slow  # two runs of two processes
def test_a_user_error_in_the_ranks_exits_2_and_torchrun_leaves_no_files(criteo_dataset, tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed_run = Path(tempfile.gettempdir()) / f"neorec-torchrun-{int(gone.stdout)}-abc123"  # its maker SIGKILLed
    (killed_run / "exits").mkdir(parents=True)
    live_run = Path(tempfile.mkdtemp(prefix=f"neorec-torchrun-{os.getpid()}-"))  # a run still at work
    before = _torchrun_dirs() - {killed_run.name}
    missing = neorec("train", "configs/demo.toml", "--nproc", "2", "--set", "data.path='/nonexistent'",
                     "--set", f"run.dir='{tmp_path / 'missing'}'")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert missing.stderr.count("neorec: error:") == 1 and "/nonexistent" in missing.stderr
    refused = neorec("train", "configs/demo.toml", "--nproc", "2", *_settings(criteo_dataset, tmp_path / "run"),
                     "--set", "train.batch_size=100000")  # found by the ranks: their one line, torchrun's report
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "neorec: error: split 'train'" in refused.stderr and "Traceback" not in refused.stderr
    assert re.search(r"^torchrun: .*rank [01] \(pid \d+\) exited with status 2", refused.stderr,
                     re.MULTILINE), refused.stderr[-3000:]  # both ranks find it: either may exit first
    planned = neorec_in_process("train", "configs/demo.toml", "--nproc", "2",
                                *_settings(criteo_dataset, tmp_path / "run"), "--set",
                                "sharding.tables.t_C1='table_wise:5'")  # found before the ranks start
    assert planned.returncode == 2 and planned.stderr.strip() == \
        "neorec: error: table 't_C1': rank 5 is outside world size 2", planned.stderr
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "metrics.jsonl").write_text("{}\n")  # another run's: rank 0 claims the directory alone
    alone = neorec("train", "configs/demo.toml", "--nproc", "2", *_settings(criteo_dataset, tmp_path / "held"))
    assert alone.returncode == 2, alone.stderr[-3000:]
    assert alone.stderr.count("neorec: error:") == 1 and "already holds a run" in alone.stderr
    assert "neorec: rank 1 stopped with rank 0, whose error is above" in alone.stderr
    assert "RuntimeError" not in alone.stderr, alone.stderr[-3000:]  # not the gloo traceback of rank 1
    assert _torchrun_dirs() <= before and live_run.is_dir()  # another run's may go: it was abandoned too
    live_run.rmdir()


@pytest.mark.slow  # three attempts of two ranks
def test_a_user_error_is_not_retried_by_elastic_restarts(criteo_dataset, tmp_path):
    """Under ``--max-restarts 2`` the agent starts the ranks again after any failure; after
    a user's error they exit 2 at once rather than load the data and meet it again."""
    refused = neorec("train", "configs/demo.toml", "--nproc", "2", "--max-restarts", "2",
                     *_settings(criteo_dataset, tmp_path / "run"), "--set", "train.batch_size=100000")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert 1 <= refused.stderr.count("neorec: error: split 'train'") <= 2, refused.stderr[-3000:]  # one attempt's
    assert refused.stderr.count("neorec: error: not started again: rank 0 stopped with an error above that a "
                                "restart cannot mend") == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_a_killed_rank_is_named_as_killed_not_left_to_torchrun_s_traceback(criteo_dataset, tmp_path):
    """A rank the kernel kills (its out-of-memory killer, say) records no exit status; the
    command says so in one line after torchrun's report."""
    run = tmp_path / "run"
    process = subprocess.Popen([*NEOREC, "train", "configs/demo.toml", "--nproc", "2", "--set", "train.epochs=100",
                                *_settings(criteo_dataset, run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.2)
        os.kill(_rank_processes(process.pid)[1], signal.SIGKILL)
        _, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    assert "ended without an exit status: killed by a signal" in stderr.splitlines()[-1], stderr[-3000:]
    assert re.search(r"rank 1 \(pid \d+\) was ended by SIGKILL", stderr) and "Traceback" not in stderr, stderr[-3000:]
