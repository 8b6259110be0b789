"""The ``neorec`` command as a user runs it (a real subprocess)."""

import json
import os
import re
import subprocess

import pytest

from neorec.orchestration import cli_data

from tests.trainer.test_train import untimed
from tests.ingest.workers import start_worker, stop_all
from tests.cli import NEOREC, neorec, neorec_in_process


def test_synth_train_eval_round_trip(tmp_path):
    data = tmp_path / "data"
    result = neorec("data", "synth", "--profile", "criteo", "--rows", "3000", "--out", str(data))
    assert result.returncode == 0, result.stderr
    assert json.loads((data / "dataset.json").read_text())["rows"] == {"train": 2400, "eval": 600}
    run = tmp_path / "run"
    result = neorec("train", "configs/demo.toml", "--set", f"data.path='{data}'", "--set", f"run.dir='{run}'",
                    "--set", "train.batch_size=256", "--set", "model.max_table_rows=1000", "--status-port", "0")
    assert result.returncode == 0, result.stderr
    assert re.search(r"trainer status served on 127\.0\.0\.1:[1-9]\d* \(neorec status ", result.stderr), result.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert "eval AUC" in result.stdout and "oracle" in result.stdout
    result = neorec("eval", "configs/demo.toml", "--checkpoint", str(run / "checkpoint"),
                    "--set", f"data.path='{data}'", "--set", "model.max_table_rows=1000")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["auc"] == summary["eval_auc"]
    result = neorec("eval", "--checkpoint", str(run))  # the checkpoint holds its config
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["auc"] == summary["eval_auc"]


def test_errors_are_reported_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nbach_size = 3\n")
    result = neorec("train", str(bad))
    assert result.returncode == 2
    assert "unknown key 'train.bach_size'" in result.stderr
    assert "Traceback" not in result.stderr
    result = neorec("train", "configs/demo.toml", "--set", f"data.path='{tmp_path}/none'")
    assert result.returncode == 2 and "not a neorec dataset directory" in result.stderr


@pytest.mark.parametrize("flags,error", [
    (["ingest", "--threads", "1"], "--threads is for neorec bench tbe, not ingest"),
    (["store", "--nproc", "2"], "--nproc is for neorec bench train and collectives, not store"),
    (["tbe", "--contend"], "--contend is for neorec bench train, not tbe"),
    (["train", "--contend", "--nproc", "2"], "--contend measures one process beside a competing one"),
])
def test_a_bench_flag_the_benchmark_does_not_take_is_refused(flags, error):
    result = neorec("bench", *flags)
    assert result.returncode == 2 and result.stderr.startswith(f"neorec: error: {error}"), result.stderr


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_bench_quick_times_both_sides_training_the_same_model(tmp_path):
    out = tmp_path / "bench.json"
    result = neorec("bench", "train", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["fused_qps"] > 0 and report["baseline_qps"] > 0
    # same steps on the same batches: the same tables, but for rounding, which Adagrad's first
    # update of a row (about lr * sign(gradient) with eps 1e-10) lets show for tiny gradients;
    # a side that trained otherwise would be off by about lr (0.05)
    assert report["max_table_difference"] < 1e-3
    ceiling = report["dense_ceiling"]
    assert len(ceiling["fraction_of_ceiling_by_round"]) == 2  # the quick run's rounds
    assert min(ceiling["fraction_of_ceiling_by_round"]) > 0
    assert ceiling["embeddings_alone_ms"] > 0 and 0 < ceiling["fraction_at_standalone_cost"] < 1


@pytest.mark.slow  # two torchrun jobs of two ranks, ~9 s: CI runs it with -m slow
def test_bench_collectives_quick_times_two_sums_that_agree_at_every_size(tmp_path):
    out = tmp_path / "bench.json"
    result = neorec("bench", "collectives", "--quick", "--nproc", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["nproc"] == 2 and len(report["sizes"]) == 5
    for size, timed in report["sizes"].items():
        assert timed["max_difference_from_all_reduce"] <= 1e-5  # randn summed over 2 ranks, float32
        assert timed["all_reduce_ms"] > 0 and timed["all_to_all_sum_ms"] > 0
        assert timed["all_to_all_bytes_per_rank"] == 2 * int(size)
        for precision in ("fp16", "bf16"):
            assert timed["reduced_precision"][precision]["wire_bytes_over_fp32"] == 0.5


def test_train_through_a_reader_service_equals_in_process(criteo_dataset, tmp_path):
    common = ["--set", f"data.path='{criteo_dataset.root}'", "--set", "train.batch_size=256",
              "--set", "model.max_table_rows=1000"]
    local = neorec("train", "configs/demo.toml", "--set", f"run.dir='{tmp_path / 'local'}'", *common)
    assert local.returncode == 0, local.stderr
    worker = start_worker()
    try:
        remote = neorec("train", "configs/demo.toml", "--ingest", worker.address,
                        "--set", f"run.dir='{tmp_path / 'remote'}'", *common)
        assert remote.returncode == 0, remote.stderr
        status = neorec("ingest", "status", worker.address)
        assert status.returncode == 0, status.stderr
        counters = json.loads(status.stdout)
    finally:
        stop_all([worker])
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("local", "remote")]
    assert untimed(summaries[0]) == untimed(summaries[1])
    steps = summaries[1]["steps"]
    assert int(counters["rowsServed"]) == steps * 256 + criteo_dataset.rows["eval"]
    assert int(counters["errors"]) == 0 and counters["activeStreams"] == 0


def test_unreachable_reader_service_is_a_clear_error(criteo_dataset, tmp_path):
    worker = start_worker()
    worker.kill()
    result = neorec("train", "configs/demo.toml", "--ingest", worker.address,
                    "--set", f"data.path='{criteo_dataset.root}'", "--set", f"run.dir='{tmp_path}'",
                    "--set", "data.ingest_stall_timeout_s=1.0")
    assert result.returncode == 2
    assert f"{worker.address}: UNAVAILABLE" in result.stderr and "Traceback" not in result.stderr
    for group in ("ingest", "store"):  # a service's counters: the same one line and exit status
        result = neorec(group, "status", worker.address, "--timeout", "1")
        assert result.returncode == 2, (group, result.stderr)
        assert result.stderr.startswith("neorec: error:") and worker.address in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_output_closed_by_its_reader_ends_the_command_quietly_with_141(tmp_path):
    """``neorec … | head`` that stops reading: the command's work is done, and its end is
    the shell's status for SIGPIPE, not a BrokenPipeError traceback."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's output, as usual
        result = subprocess.run([*NEOREC, "data", "synth", "--rows", "500", "--out", str(tmp_path / "d")],
                                stdout=writer, stderr=subprocess.PIPE, text=True, timeout=300, env=buffered)
    finally:
        os.close(writer)
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert json.loads((tmp_path / "d" / "dataset.json").read_text())["rows"]["train"] == 400


def test_a_broken_pipe_that_is_not_the_output_stays_a_defect(monkeypatch, tmp_path):
    def broken(args):
        raise BrokenPipeError("a connection of the command's own")

    monkeypatch.setattr(cli_data, "_synth", broken)
    with pytest.raises(BrokenPipeError):
        neorec_in_process("data", "synth", "--rows", "10", "--out", tmp_path / "d")
