"""``neorec data import|convert|synth`` never damage a dataset already in ``--out``: a
non-empty output directory is refused unless ``--overwrite``; with it, the new dataset is
written beside the old one and renamed into place only when complete, so an import that
fails half-way leaves the old dataset as it was and no temporary directory behind."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.common.errors import PathError
from neorec.ingest.staging import OutputExistsError, staged_output
from neorec.ingest.importer import import_dataset
from tests.ingest.test_importer import spec, write_log
from tests.cli import NEOREC, neorec_in_process

IMPORT_FLAGS = ["--format", "csv", "--label", "rating", "--label-transform", ">= 4", "--dense", "count",
                "--categorical", "user,item", "--split", "ordered", "--eval-fraction", "0.25",
                "--set", "output.file_rows=500", "--set", "output.row_group_rows=250"]


def _contents(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _error_line(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("neorec: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_a_non_empty_output_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "data"
    assert neorec_in_process("data", "synth", "--rows", "300", "--out", str(out)).returncode == 0
    before = _contents(out)
    for command in (["data", "synth", "--rows", "200", "--seed", "1", "--out", str(out)],
                    ["data", "import", "--files", str(tmp_path / "log.csv"), *IMPORT_FLAGS, "--out", str(out)],
                    ["data", "convert", "criteo", str(tmp_path / "day_0.tsv"), "--out", str(out)]):
        (tmp_path / "log.csv").touch()
        (tmp_path / "day_0.tsv").touch()
        line = _error_line(neorec_in_process(*command))
        assert f"{out} is not empty" in line and "--overwrite" in line
    assert _contents(out) == before
    replaced = neorec_in_process("data", "synth", "--rows", "200", "--seed", "1", "--out", str(out), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert _contents(out) != before and (out / "dataset.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "day_0.tsv", "log.csv"]


def test_a_failed_overwrite_leaves_the_old_dataset_intact(tmp_path):
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    write_log(good, rows=1500)
    write_log(bad, rows=1500, seed=1)
    with open(bad, "a") as f:  # a bad row after the first file's rows were written out
        f.write("u1,3,x7,a,10,4\n")
    out = tmp_path / "data"
    first = neorec_in_process("data", "import", "--files", str(good), *IMPORT_FLAGS, "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = _contents(out)
    failed = neorec_in_process("data", "import", "--files", str(good), str(bad), *IMPORT_FLAGS, "--out", str(out),
                               "--overwrite")
    assert "column 'count'" in _error_line(failed)
    assert _contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv", "data", "good.csv"]  # no temporary left


def test_the_output_directory_gets_the_mode_mkdir_gives_under_the_umask(tmp_path):
    umask = 0o027  # neither tempfile's 0700 nor the usual umask's 0755
    before = os.umask(umask)
    try:
        out = tmp_path / "data"
        for overwrite in (False, True):  # a new output, then one replacing it
            with staged_output(out, overwrite=overwrite) as staging:
                (staging / "dataset.json").write_text("{}")
            assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask, oct(out.stat().st_mode)
    finally:
        os.umask(before)


def test_a_full_disk_is_named_with_the_output_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "data"
    with pytest.raises(PathError, match=f"^cannot write the dataset {out}: no space left on device$"):
        with staged_output(out) as staging:
            (staging / "train-00000.parquet").write_bytes(b"part of a file")
            raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="not a write the disk refused"):  # anything else passes through
        with staged_output(out):
            raise ValueError("not a write the disk refused")


def test_a_disk_that_refuses_an_imported_file_is_named_and_not_hidden_by_closing_it(tmp_path, monkeypatch):
    """The disk fills as a row group is written; Arrow's writer then holds a closed file, so
    flushing its rows again as the import stops raises "operation on a closed file", which
    must not replace the disk's error (as on a full tmpfs)."""
    class DiskFills(pq.ParquetWriter):
        failed = False

        def write_table(self, table, row_group_size=None) -> None:
            if self.failed:
                raise pa.ArrowInvalid("Operation on closed file")
            if str(self.where).endswith("train-00000.parquet"):
                self.failed = True
                raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
            super().write_table(table, row_group_size=row_group_size)

    monkeypatch.setattr(pq, "ParquetWriter", DiskFills)
    write_log(tmp_path / "log.csv")
    out = tmp_path / "data"
    with pytest.raises(PathError, match=f"^cannot write the dataset {out}: no space left on device$"):
        with staged_output(out) as staging:
            import_dataset(spec(tmp_path / "log.csv"), staging)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.csv"]


@pytest.mark.parametrize("inside", ["log.csv", "*.csv", "."])
def test_overwrite_refuses_an_output_that_holds_an_input_or_the_current_directory(tmp_path, monkeypatch, inside):
    out = tmp_path / "data"
    assert neorec_in_process("data", "synth", "--rows", "300", "--out", str(out)).returncode == 0
    write_log(out / "log.csv")
    before = _contents(out)
    monkeypatch.chdir(out)
    command = (["data", "synth", "--rows", "200", "--out", "."] if inside == "." else
               ["data", "import", "--files", str(out / inside), *IMPORT_FLAGS, "--out", str(out)])
    line = _error_line(neorec_in_process(*command, "--overwrite"))
    if inside == ".":
        assert line == "neorec: error: . holds the current directory, which the new dataset would replace: run " \
                       "the command from another directory, or give another --out"
    else:
        assert line == f"neorec: error: {out / inside} lies in {out}, which --overwrite would replace: write the " \
                       "dataset to another --out"
    assert _contents(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_an_empty_output_holding_the_current_directory_is_refused(tmp_path, monkeypatch):
    """``mkdir data && cd data && neorec data synth --out .``: the new dataset would take
    the place of the directory the shell is in, leaving it in a removed one."""
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path / "data")
    with pytest.raises(OutputExistsError, match="^. holds the current directory, which the new dataset would "
                                                "replace"):
        with staged_output("."):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_an_output_below_a_file_is_named_with_the_file(tmp_path):
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(OutputExistsError, match=f"^{tmp_path / 'notes/data/d'} cannot be made: "
                                                f"{tmp_path / 'notes'} is a file, not a directory$"):
        with staged_output(tmp_path / "notes" / "data" / "d"):
            pass
    assert (tmp_path / "notes").read_text() == "mine"


def test_an_output_named_by_a_relative_path_is_staged_beside_it(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path / "runs")
    with staged_output("../data") as staging:
        assert staging.parent == tmp_path
        (staging / "f").write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "runs"] and (tmp_path / "data" / "f").is_file()


def test_the_staged_files_are_fsynced_before_the_output_is_renamed_into_place(tmp_path, monkeypatch):
    synced = []

    def fsync_file(path):
        synced.append((Path(path).relative_to(tmp_path), (tmp_path / "data").exists()))

    monkeypatch.setattr("neorec.common.durable.fsync_file", fsync_file)
    monkeypatch.setattr("neorec.ingest.staging.WRITEBACK_PERIOD_S", 3600.0)  # none while the block runs
    with staged_output(tmp_path / "data") as staging:
        (staging / "vocab").mkdir()
        (staging / "vocab" / "C1.parquet").write_bytes(b"ids")
        (staging / "train-00000.parquet").write_bytes(b"rows")
    inside = [str(path.relative_to(staging.name)) for path, renamed in synced if not renamed]
    assert sorted(inside) == [".", "train-00000.parquet", "vocab", "vocab/C1.parquet"]
    assert inside.index("vocab/C1.parquet") < inside.index("vocab") < inside.index(".")  # a directory after its files
    assert inside.index("train-00000.parquet") < inside.index(".")
    assert [str(path) for path, renamed in synced if renamed] == ["."]  # then the parent, holding the new name


def test_files_are_fsynced_while_the_dataset_is_written_and_a_failed_write_back_is_raised(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr("neorec.ingest.staging.WRITEBACK_PERIOD_S", 0.01)
    monkeypatch.setattr("neorec.ingest.staging.fsync_file", lambda path: synced.append(Path(path).name))
    with staged_output(tmp_path / "data") as staging:
        (staging / "train-00000.parquet").write_bytes(b"rows")
        deadline = time.monotonic() + 30
        while "train-00000.parquet" not in synced:  # written back before the writer is done
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def failing(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr("neorec.ingest.staging.fsync_file", failing)
    with pytest.raises(OSError, match="Input/output error"):  # reported, though the block itself succeeded
        with staged_output(tmp_path / "data", overwrite=True) as staging:
            (staging / "train-00000.parquet").write_bytes(b"other rows")
            time.sleep(0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # the old dataset, nothing staged left
    assert (tmp_path / "data" / "train-00000.parquet").read_bytes() == b"rows"


def test_a_terminated_write_removes_its_staging_directory_and_ends_by_the_signal(tmp_path):
    out = tmp_path / "data"
    writer = subprocess.Popen([*NEOREC, "data", "synth", "--rows",
                               "5000000", "--out", str(out)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.endswith(".partial") for p in tmp_path.iterdir()):
            assert writer.poll() is None and time.monotonic() < deadline, writer.stderr.read()
            time.sleep(0.05)
        time.sleep(0.5)  # well into writing
        writer.send_signal(signal.SIGTERM)
        assert writer.wait(timeout=60) == -signal.SIGTERM
    finally:
        writer.kill()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_writers_staging_directory_is_removed_by_the_next_write_on_its_host(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    host = socket.gethostname()
    abandoned = tmp_path / f".data.{host}.{dead_pid}.{'a1' * 8}.partial"
    running = tmp_path / f".data.{host}.{os.getpid()}.{'b2' * 8}.partial"  # a writer still at work
    elsewhere = tmp_path / f".data.other-host.{dead_pid}.{'c3' * 8}.partial"  # not ours to judge
    other_output = tmp_path / f".data2.{host}.{dead_pid}.{'d4' * 8}.partial"
    for directory in (abandoned, running, elsewhere, other_output):
        directory.mkdir()
        (directory / "train-00000.parquet").write_bytes(b"part")
    with staged_output(tmp_path / "data") as staging:
        (staging / "dataset.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["data", running.name, elsewhere.name, other_output.name])


def test_an_output_in_a_directory_that_refuses_it_is_named_not_the_staging_directory(tmp_path, monkeypatch):
    def refused(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    out = tmp_path / "ro" / "x"
    out.parent.mkdir()
    monkeypatch.setattr(Path, "mkdir", refused)  # as a read-only parent refuses the staging directory
    with pytest.raises(PathError, match=f"^cannot write the dataset {out}: permission denied$"):
        with staged_output(out):
            pass
    monkeypatch.undo()
    if os.geteuid() != 0:  # root writes anywhere
        out.parent.chmod(0o555)
        try:
            line = _error_line(neorec_in_process("data", "synth", "--rows", "100", "--out", out))
        finally:
            out.parent.chmod(0o755)
        assert line == f"neorec: error: cannot write the dataset {out}: permission denied"
    assert list(out.parent.iterdir()) == []
