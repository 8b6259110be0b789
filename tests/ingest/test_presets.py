"""``neorec data convert`` presets on hand-written fixtures in each public format: the rows,
splits and features come out as the format says, and ``neorec train`` runs on the result."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from neorec.ingest.errors import DataError
from neorec.ingest.import_spec import SpecError
from neorec.ingest.importer import import_dataset
from neorec.ingest.presets import PresetOptions, preset
from neorec.ingest.schema import Dataset
from tests.conftest import FIXTURES
from tests.cli import NEOREC


def convert(name: str, paths, out, **options) -> Dataset:
    """Preset ``name`` of one path, or of a list of them, imported into ``out``."""
    paths = [str(p) for p in paths] if isinstance(paths, list) else [str(paths)]
    spec, source = preset(name, paths, PresetOptions(**options))
    return import_dataset(spec, out, source=source, profile=name)


def rows(dataset: Dataset, split: str) -> list[dict]:
    return [r for f in dataset.files(split) for r in pq.read_table(f).to_pylist()]


def test_criteo_tsv_keeps_counts_and_the_file_order_split(tmp_path):
    dataset = convert("criteo", FIXTURES / "criteo_sample.tsv", tmp_path, eval_fraction=0.5)
    assert dataset.rows == {"train": 2, "eval": 2}  # the last rows are the eval split
    first = rows(dataset, "train")[0]
    assert first["label"] == 0.0 and first["I5"] == 1382.0 and first["I12"] == 0.0  # missing → 0
    assert first["C22"] == 0  # a missing categorical
    assert [r["label"] for r in rows(dataset, "eval")] == [0.0, 1.0]  # the fixture's third and fourth lines
    assert [f.name for f in dataset.schema.sparse] == [f"C{i}" for i in range(1, 27)]


def test_avazu_splits_by_hour(tmp_path):
    dataset = convert("avazu", FIXTURES / "avazu_sample.csv", tmp_path, eval_fraction=0.25)
    assert dataset.rows == {"train": 12, "eval": 4}  # the last of the four hours
    assert "hour" not in [f.name for f in dataset.schema.sparse] and not dataset.schema.dense
    assert [r["label"] for r in rows(dataset, "train")][:4] == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("directory,users", [("movielens-100k", True), ("movielens-1m", True),
                                             ("movielens-25m", False)])
def test_movielens_joins_users_and_genres(tmp_path, directory, users):
    dataset = convert("movielens", FIXTURES / directory, tmp_path, eval_fraction=0.25)
    names = [f.name for f in dataset.schema.sparse]
    assert names == (["user", "item", "gender", "age", "occupation", "zip", "genres"] if users
                     else ["user", "item", "genres"])
    assert dataset.schema.sparse[-1].multi_hot
    genres = pq.read_table(tmp_path / "vocab" / "genres.parquet")["value"].to_pylist()
    train = rows(dataset, "train")
    assert all(0 < i <= len(genres) for r in train for i in r["genres"])
    assert "(no genres listed)" not in genres and "" not in genres
    assert {r["label"] for r in train} <= {0.0, 1.0}


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_each_preset_trains(tmp_path):
    cases = [("criteo", FIXTURES / "criteo_sample.tsv", ["--eval-fraction", "0.5"]),
             ("avazu", FIXTURES / "avazu_sample.csv", ["--eval-fraction", "0.25"]),
             ("movielens", FIXTURES / "movielens-1m", ["--eval-fraction", "0.25"])]
    for name, path, flags in cases:
        out = tmp_path / name
        done = subprocess.run([*NEOREC, "data", "convert", name, str(path), "--out",
                               str(out), *flags], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["rows"] == Dataset.load(out).rows
        run = tmp_path / f"run-{name}"
        done = subprocess.run([*NEOREC, "train", "configs/demo.toml",
                               "--set", f"data.path='{out}'", "--set", f"run.dir='{run}'",
                               "--set", "train.batch_size=2", "--set", "data.remainder='pad'"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] >= 1 and 0 <= summary["eval_auc"] <= 1


# ----------------------------------------------------------------------- real-world variants
def criteo_line(label="0", ints=None, cats=None) -> str:
    """One Criteo TSV line: a label, 13 counts ("" missing), 26 8-hex-digit categoricals."""
    ints = ints if ints is not None else ["1", "-1", "", *map(str, range(10))]
    cats = cats if cats is not None else [f"{k:08x}" for k in range(26)]
    return "\t".join([label, *ints, *cats])


def write_criteo(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("lines,where", [
    ([criteo_line(), criteo_line(), criteo_line() + "\textra", criteo_line()], "line 3: 41 fields, expected 40"),
    ([criteo_line()[2:]] * 3, "line 1: 39 fields, expected 40; this looks like Criteo's unlabelled test file, "
                              "which cannot be imported for training (it has no label)"),  # test.txt: no label column
    ([criteo_line().replace("\t", " ")], "line 1: 1 field, expected 40"),  # spaces, not tabs
])
def test_a_criteo_row_of_the_wrong_width_is_named(tmp_path, lines, where):
    path = write_criteo(tmp_path / "day_0", lines)
    with pytest.raises(DataError, match=re.escape(f"file {path}, {where}") + "$"):
        convert("criteo", path, tmp_path / "out")


def test_an_avazu_row_of_the_wrong_width_is_named(tmp_path):
    lines = (FIXTURES / "avazu_sample.csv").read_text().splitlines()
    lines[3] += ",x"
    path = tmp_path / "train.csv"
    path.write_text("\r\n".join(lines) + "\r\n")
    with pytest.raises(DataError, match="train.csv, line 4: 25 fields, expected 24"):
        convert("avazu", path, tmp_path / "out")


def test_avazu_s_unlabelled_test_file_is_named_as_one(tmp_path):
    lines = [line.split(",") for line in (FIXTURES / "avazu_sample.csv").read_text().splitlines()]
    path = tmp_path / "test.csv"
    path.write_text("".join(",".join(fields[:1] + fields[2:]) + "\n" for fields in lines))  # no click column
    with pytest.raises(DataError, match=f"^file {path}: no column 'click' \\(it has id, hour, C1, .*\\); this looks "
                                        "like Avazu's unlabelled test file, which cannot be imported for training"):
        convert("avazu", path, tmp_path / "out")


@pytest.mark.parametrize("index,where", [
    (0, "column 'label', line 3: the label must be a number, got 'x1'"),
    (3, "column 'I3', line 3: a dense column must hold numbers, got 'x1'"),
])
def test_a_criteo_value_that_is_not_a_number_is_named(tmp_path, index, where):
    bad = criteo_line().split("\t")
    bad[index] = "x1"
    path = write_criteo(tmp_path / "day_0", [criteo_line(), criteo_line("1"), "\t".join(bad), criteo_line()])
    with pytest.raises(DataError, match=where):
        convert("criteo", path, tmp_path / "out")


def test_a_count_missing_from_the_first_block_is_read_in_later_ones(tmp_path, monkeypatch):
    monkeypatch.setattr("neorec.ingest.sources.BLOCK_BYTES", 1024)  # blocks of a few lines
    empty_i12 = [str(i) for i in range(11)] + ["", "7"]
    lines = [criteo_line(str(n % 2), empty_i12) for n in range(40)] + \
        [criteo_line(str(n % 2), [*empty_i12[:11], "-2", "7"]) for n in range(10)]
    dataset = convert("criteo", write_criteo(tmp_path / "day_0", lines), tmp_path / "out", eval_fraction=0.2)
    assert [r["I12"] for r in rows(dataset, "eval")] == [-2.0] * 10


def test_a_glob_of_criteo_days_is_in_day_order(tmp_path):
    for day in (1, 2, 10):
        write_criteo(tmp_path / f"day_{day}", [criteo_line(str(n % 2), [str(day)] * 13) for n in range(4)])
    dataset = convert("criteo", tmp_path / "day_*", tmp_path / "out", eval_fraction=0.25)
    assert {r["I1"] for r in rows(dataset, "eval")} == {10.0}  # the last day (in the text's order: day_2)
    as_the_shell_lists_them = [str(tmp_path / f"day_{day}") for day in (1, 10, 2)]
    dataset = convert("criteo", as_the_shell_lists_them, tmp_path / "out2", eval_fraction=0.25)
    assert {r["I1"] for r in rows(dataset, "eval")} == {10.0}
    (tmp_path / "a").mkdir()  # by file name wherever each lies: a/day_10 is still the last day
    (tmp_path / "day_10").rename(tmp_path / "a" / "day_10")
    dataset = convert("criteo", [tmp_path / "a" / "day_10", tmp_path / "day_*"], tmp_path / "out3", eval_fraction=0.25)
    assert {r["I1"] for r in rows(dataset, "eval")} == {10.0}


def test_criteo_eval_files_must_be_among_the_files(tmp_path):
    days = [write_criteo(tmp_path / f"day_{d}", [criteo_line(str(n % 2), [str(d)] * 13) for n in range(4)])
            for d in range(3)]
    spec, _ = preset("criteo", [str(d) for d in days[:2]], PresetOptions(eval_files=(str(days[2]),)))
    with pytest.raises(DataError, match="day_2: an eval file must also be one of the files to import"):
        import_dataset(spec, tmp_path / "out")
    other_spelling = str(tmp_path / ".." / tmp_path.name / "day_1")
    spec, _ = preset("criteo", [str(d) for d in days[:2]], PresetOptions(eval_files=(other_spelling,)))
    dataset = import_dataset(spec, tmp_path / "out")
    assert {r["I1"] for r in rows(dataset, "eval")} == {1.0}
    spec, _ = preset("criteo", [str(days[0])], PresetOptions(eval_files=(str(days[0]),)))
    with pytest.raises(DataError, match="day_0: every file to import is an eval file"):
        import_dataset(spec, tmp_path / "out2")


def test_a_directory_or_an_archive_is_refused_by_name(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"file {tmp_path}: a directory")):
        convert("criteo", tmp_path, tmp_path / "out")
    archive = tmp_path / "avazu-ctr-prediction.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.write(FIXTURES / "avazu_sample.csv", "train.csv")
    with pytest.raises(DataError, match="avazu-ctr-prediction.zip: an archive: extract its files"):
        convert("avazu", archive, tmp_path / "out")


def test_min_count_and_hash_rows_together_are_refused():
    with pytest.raises(SpecError, match="--min-count caps a vocabulary and --hash-rows hashes"):
        preset("criteo", [str(FIXTURES / "criteo_sample.tsv")], PresetOptions(min_count=2, hash_rows=1000))


def test_eval_files_and_an_eval_fraction_together_are_refused():
    with pytest.raises(SpecError, match="--eval-files makes those files the eval split and --eval-fraction"):
        preset("criteo", [str(FIXTURES / "criteo_sample.tsv")],
               PresetOptions(eval_files=(str(FIXTURES / "criteo_sample.tsv"),), eval_fraction=0.5))


def test_movielens_refuses_eval_files(tmp_path):
    with pytest.raises(SpecError, match="--eval-files: MovieLens is split by timestamp"):
        preset("movielens", [str(FIXTURES / "movielens-1m")], PresetOptions(eval_files=("ratings.dat",)))


@pytest.mark.parametrize("directory,damage,where", [
    ("movielens-100k", ("u.data", lambda t: t.replace("\t3\t881250949", "\t3", 1)),
     "u.data, line 1: 3 fields, expected 4"),
    ("movielens-100k", ("u.item", lambda t: t.replace("|0|", "|", 1)), "u.item, line 1: 23 fields, expected 24"),
    ("movielens-100k", ("u.data", lambda t: ""), "u.data: cannot read it"),
    ("movielens-25m", ("ratings.csv", lambda t: t.replace("1147880044", "1147880044,x", 1)),
     "ratings.csv, line 2: 5 fields, expected 4"),
    ("movielens-25m", ("movies.csv", None), "movies.csv: missing from the MovieLens directory"),
    ("movielens-1m", ("ratings.dat", lambda t: t.replace("::5::", "::x::", 1)),
     "ratings.dat, column 'rating', line 1: the label must be a number, got 'x'"),
    ("movielens-25m", ("ratings.csv", lambda t: t.replace("5.0,1147880044", "x,1147880044", 1)),
     "ratings.csv, column 'rating', line 2: the label must be a number, got 'x'"),
    ("movielens-25m", ("ratings.csv", lambda t: "\n".join(",".join(line.split(",")[:3]) for line in t.split("\n"))),
     "ratings.csv: no column 'timestamp' \\(it has userId, movieId, rating\\)"),
    ("movielens-1m", ("users.dat", lambda t: t.replace("::48067", "::48067::extra", 1)),
     "users.dat, line 1: expected 5 fields separated by '::', got 6"),
    ("movielens-1m", ("movies.dat", lambda t: t.replace("Musical\n", "Musical::extra\n", 1)),
     "movies.dat, line 1: expected 3 fields separated by '::', got 4"),
    ("movielens-1m", ("ratings.dat", lambda t: "\n\n" + t.replace("::978302109", "::978302109::7", 1)),
     "ratings.dat, line 4: expected 4 fields separated by '::', got 5"),
    ("movielens-100k", ("u.item", lambda t: t.replace("|0|1|0|0|", "|0|x|0|0|", 1)),
     "u.item, column 'Action', line 1: a genre flag must be 0 or 1, got 'x'"),
])
def test_a_damaged_movielens_file_is_named(tmp_path, directory, damage, where):
    copy = Path(shutil.copytree(FIXTURES / directory, tmp_path / directory))
    name, change = damage
    if change is None:
        (copy / name).unlink()
    else:
        (copy / name).write_bytes(change((copy / name).read_bytes().decode("latin-1")).encode("latin-1"))
    with pytest.raises(DataError, match=where):
        convert("movielens", copy, tmp_path / "out")


def test_movielens_csv_columns_are_found_by_their_header_and_a_byte_order_mark_is_dropped(tmp_path):
    """ratings.csv and movies.csv by their columns' names (reordered, one more); a .dat file
    (Latin-1) that begins with a UTF-8 byte order mark reads as the same file without it."""
    expected = rows(convert("movielens", FIXTURES / "movielens-25m", tmp_path / "plain", eval_fraction=0.25), "train")
    copy = Path(shutil.copytree(FIXTURES / "movielens-25m", tmp_path / "reordered"))
    lines = (copy / "ratings.csv").read_text().splitlines()
    (copy / "ratings.csv").write_text("\n".join(",".join([f[2], f[1], f[3], f[0]]) for f in
                                                (line.split(",") for line in lines)) + "\n")
    text = (copy / "movies.csv").read_text().splitlines()  # a column more: the header says which is which
    (copy / "movies.csv").write_text("\n".join([text[0] + ",year"] + [line + ",1995" for line in text[1:]]) + "\n")
    assert rows(convert("movielens", copy, tmp_path / "out", eval_fraction=0.25), "train") == expected

    plain = rows(convert("movielens", FIXTURES / "movielens-1m", tmp_path / "plain1m", eval_fraction=0.25), "train")
    marked = Path(shutil.copytree(FIXTURES / "movielens-1m", tmp_path / "marked"))
    for name in ("ratings.dat", "users.dat", "movies.dat"):
        (marked / name).write_bytes(b"\xef\xbb\xbf" + (marked / name).read_bytes())
    assert rows(convert("movielens", marked, tmp_path / "out1m", eval_fraction=0.25), "train") == plain


def test_a_parquet_file_given_as_text_is_named_as_one(tmp_path):
    dataset = convert("criteo", FIXTURES / "criteo_sample.tsv", tmp_path / "d", eval_fraction=0.5)
    parquet = dataset.files("train")[0]
    with pytest.raises(DataError, match=re.escape(f"file {parquet}: a Parquet file, not delimited text")):
        convert("criteo", parquet, tmp_path / "out")
    command = subprocess.run([*NEOREC, "data", "convert", "criteo", str(parquet), "--out",
                              str(tmp_path / "out2")], capture_output=True, text=True, timeout=120)
    assert command.returncode == 2 and len(command.stderr.strip().splitlines()) == 1, command.stderr
