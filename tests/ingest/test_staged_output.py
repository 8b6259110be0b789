"""``neorec data import|convert|synth`` never damage a dataset already in ``--out``: a
non-empty output directory is refused unless ``--overwrite``; with it, the new dataset is
written beside the old one and renamed into place only when complete, so an import that
fails half-way leaves the old dataset as it was and no temporary directory behind."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from neorec.common.errors import PathError
from neorec.ingest.staging import staged_output
from tests.ingest.test_importer import write_log

IMPORT_FLAGS = ["--format", "csv", "--label", "rating", "--label-transform", ">= 4", "--dense", "count",
                "--categorical", "user,item", "--split", "ordered", "--eval-fraction", "0.25",
                "--set", "output.file_rows=500", "--set", "output.row_group_rows=250"]


def _neorec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neorec.orchestration.cli", *args], capture_output=True, text=True,
                          timeout=300)


def _contents(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _error_line(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("neorec: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_a_non_empty_output_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "data"
    assert _neorec("data", "synth", "--rows", "300", "--out", str(out)).returncode == 0
    before = _contents(out)
    for command in (["data", "synth", "--rows", "200", "--seed", "1", "--out", str(out)],
                    ["data", "import", "--files", str(tmp_path / "log.csv"), *IMPORT_FLAGS, "--out", str(out)],
                    ["data", "convert", "criteo", str(tmp_path / "day_0.tsv"), "--out", str(out)]):
        (tmp_path / "log.csv").touch()
        (tmp_path / "day_0.tsv").touch()
        line = _error_line(_neorec(*command))
        assert f"{out} is not empty" in line and "--overwrite" in line
    assert _contents(out) == before
    replaced = _neorec("data", "synth", "--rows", "200", "--seed", "1", "--out", str(out), "--overwrite")
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
    first = _neorec("data", "import", "--files", str(good), *IMPORT_FLAGS, "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = _contents(out)
    failed = _neorec("data", "import", "--files", str(good), str(bad), *IMPORT_FLAGS, "--out", str(out), "--overwrite")
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
