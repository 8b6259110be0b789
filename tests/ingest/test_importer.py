"""``neorec data import`` against a plain-Python reference (the csv module, Counter): the same
splits, ids, dense values and lists; unseen and missing values are 0; vocabularies carry
over to new data; bad input is named."""

from __future__ import annotations

import csv
import math
import os
import re
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.ingest.errors import DataError
from neorec.ingest.import_spec import ImportSpec, SpecError
from neorec.ingest.importer import import_dataset
from tests.ingest.workers import with_a_bit_flipped_in_each_column

ROWS = 3000


def write_log(path: Path, rows: int = ROWS, seed: int = 0, users: int = 300) -> None:
    """A click log: user (string ids, Zipf), item (integers), a dense count with gaps, genres
    (``|``-delimited, some empty), a timestamp (not sorted), a rating."""
    rng = np.random.default_rng(seed)
    genres = ["action", "drama", "comedy", "noir", "sci-fi"]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["user", "item", "count", "genres", "ts", "rating"])
        for i in range(rows):
            user = f"u{min(int(rng.zipf(1.3)), users):04d}"
            item = int(rng.integers(0, 50))
            count = "" if rng.random() < 0.1 else int(rng.integers(0, 100))
            tags = "|".join(rng.choice(genres, int(rng.integers(0, 3)), replace=False)) if rng.random() < 0.9 else ""
            out.writerow([user, item, count, tags, int(rng.integers(0, 10_000)), int(rng.integers(1, 6))])


def spec(path: Path, **sections) -> ImportSpec:
    raw = {"input": {"files": [str(path)]}, "label": {"column": "rating", "transform": ">= 4"},
           "dense": {"columns": ["count"], "transform": "standardize", "fill": 0.0},
           "categorical": {"columns": ["user", "item"]}, "multivalued": {"columns": {"genres": "|"}},
           "split": {"kind": "chronological", "time_column": "ts", "eval_fraction": 0.25},
           "output": {"row_group_rows": 1000, "file_rows": 2000}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return ImportSpec.from_dict(raw)


def reference(path: Path, eval_fraction: float = 0.25) -> dict:
    """The import done by hand: chronological split (ties in file order), vocabularies of
    the train rows by count then value, standardized dense values, lists of ids."""
    rows = list(csv.DictReader(open(path)))
    train_rows = round(len(rows) * (1 - eval_fraction))
    order = sorted(range(len(rows)), key=lambda i: (int(rows[i]["ts"]), i))
    is_train = [False] * len(rows)
    for i in order[:train_rows]:
        is_train[i] = True
    train = [r for r, t in zip(rows, is_train) if t]

    def vocab(values) -> dict[str, int]:
        counts = Counter(values)
        ranked = sorted(counts, key=lambda v: (-counts[v], v))
        return {v: i + 1 for i, v in enumerate(ranked)}

    vocabs = {"user": vocab(r["user"] for r in train), "item": vocab(r["item"] for r in train),
              "genres": vocab(g for r in train for g in r["genres"].split("|") if g)}
    present = [float(r["count"]) for r in train if r["count"] != ""]
    mean = sum(present) / len(present)
    std = math.sqrt(sum((x - mean) ** 2 for x in present) / len(present))
    out = {"train": [], "eval": []}
    for row, train_row in zip(rows, is_train):
        count = float(row["count"]) if row["count"] != "" else 0.0
        out["train" if train_row else "eval"].append({
            "label": float(int(row["rating"]) >= 4), "count": (count - mean) / std,
            "user": vocabs["user"].get(row["user"], 0), "item": vocabs["item"].get(row["item"], 0),
            "genres": [vocabs["genres"].get(g, 0) for g in row["genres"].split("|") if g]})
    return {"splits": out, "vocabs": vocabs}


def rows_of(dataset, split: str) -> list[dict]:
    return [r for f in dataset.files(split) for r in pq.read_table(f).to_pylist()]


def test_import_equals_the_plain_python_reference(tmp_path):
    write_log(tmp_path / "log.csv")
    dataset = import_dataset(spec(tmp_path / "log.csv"), tmp_path / "out")
    expected = reference(tmp_path / "log.csv")
    for split in ("train", "eval"):
        got, want = rows_of(dataset, split), expected["splits"][split]
        assert len(got) == len(want) == dataset.rows[split]
        for g, w in zip(got, want):
            assert {k: g[k] for k in ("label", "user", "item", "genres")} == \
                {k: w[k] for k in ("label", "user", "item", "genres")}
            assert g["count"] == pytest.approx(w["count"], abs=1e-5)
    assert len(dataset.files("train")) == 2  # file_rows = 2000 of 2250 train rows
    cardinality = {f.name: f.cardinality for f in dataset.schema.sparse}
    assert cardinality == {name: len(v) + 1 for name, v in expected["vocabs"].items()}
    assert [f.multi_hot for f in dataset.schema.sparse] == [False, False, True]
    evals = expected["splits"]["eval"]
    assert any(r["user"] == 0 for r in evals)  # users first seen in the eval split are unseen: 0


def test_imported_files_and_vocabularies_carry_page_checksums(tmp_path):
    write_log(tmp_path / "log.csv")
    dataset = import_dataset(spec(tmp_path / "log.csv"), tmp_path / "out")
    written = [*dataset.files("train"), *dataset.files("eval"), *sorted((tmp_path / "out" / "vocab").glob("*.parquet"))]
    assert len(written) > 3
    for path in written:
        for data in with_a_bit_flipped_in_each_column(path, row_group=0):
            with pytest.raises(OSError, match="CRC checksum verification failed"):
                pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True).read_row_group(0)


def test_vocabularies_carry_over_to_new_data(tmp_path):
    write_log(tmp_path / "old.csv", seed=0)
    write_log(tmp_path / "new.csv", rows=500, seed=1)
    old = import_dataset(spec(tmp_path / "old.csv"), tmp_path / "old")
    new = import_dataset(spec(tmp_path / "new.csv"), tmp_path / "new", vocab_from=tmp_path / "old")
    assert {f.name: f.cardinality for f in new.schema.sparse} == {f.name: f.cardinality for f in old.schema.sparse}
    vocab = pq.read_table(tmp_path / "old" / "vocab" / "user.parquet")["value"].to_pylist()
    raw = list(csv.DictReader(open(tmp_path / "new.csv")))
    encoded = rows_of(new, "train") + rows_of(new, "eval")
    by_user = {}
    for row in encoded:
        by_user.setdefault(row["user"], set())
    expected_ids = {vocab.index(r["user"]) + 1 if r["user"] in vocab else 0 for r in raw}
    assert set(by_user) == expected_ids
    assert new.generator["dense_stats"] == old.generator["dense_stats"]


def test_min_count_max_rows_and_hashing(tmp_path):
    write_log(tmp_path / "log.csv")
    capped = import_dataset(spec(tmp_path / "log.csv", categorical={"min_count": 3, "max_rows": 20}), tmp_path / "c")
    vocab = reference(tmp_path / "log.csv")["vocabs"]["user"]
    assert {f.name: f.cardinality for f in capped.schema.sparse}["user"] == 20
    rows = rows_of(capped, "train")
    assert max(r["user"] for r in rows) == 19 and any(r["user"] == 0 for r in rows)
    hashed = import_dataset(spec(tmp_path / "log.csv", categorical={"encoding": "hash", "hash_rows": 64},
                                 split={"kind": "random", "seed": 3}), tmp_path / "h")
    again = import_dataset(spec(tmp_path / "log.csv", categorical={"encoding": "hash", "hash_rows": 64},
                                split={"kind": "random", "seed": 3}), tmp_path / "h2")
    assert rows_of(hashed, "train") == rows_of(again, "train")  # deterministic
    ids = np.array([r["user"] for r in rows_of(hashed, "train") + rows_of(hashed, "eval")])
    assert ids.min() >= 1 and ids.max() < 64 and len(set(ids.tolist())) > 40
    assert 0.2 < hashed.rows["eval"] / ROWS < 0.3
    assert len(vocab) > 20


def test_the_same_input_imports_to_the_same_bytes(tmp_path):
    """Every file of the dataset, dataset.json included (it recorded the import's wall time)."""
    write_log(tmp_path / "log.csv")
    for out in ("a", "b"):
        import_dataset(spec(tmp_path / "log.csv"), tmp_path / out)
    files = {out: {p.relative_to(tmp_path / out): p.read_bytes() for p in sorted((tmp_path / out).rglob("*"))
                   if p.is_file()} for out in ("a", "b")}
    assert files["a"].keys() == files["b"].keys() and len(files["a"]) > 3
    assert [name for name in files["a"] if files["a"][name] != files["b"][name]] == []


def test_a_parquet_list_column_round_trips(tmp_path):
    table = pa.table({"click": [1, 0, 1, 0], "tags": [["a", "b"], None, [], ["b", "c", "zz"]],
                      "t": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "in.parquet")
    dataset = import_dataset(ImportSpec.from_dict({
        "input": {"files": [str(tmp_path / "in.parquet")], "format": "parquet"}, "label": {"column": "click"},
        "multivalued": {"columns": {"tags": ""}},
        "split": {"kind": "chronological", "time_column": "t", "eval_fraction": 0.25}}), tmp_path / "out")
    vocab = pq.read_table(tmp_path / "out" / "vocab" / "tags.parquet")["value"].to_pylist()
    decoded = [[vocab[i - 1] if i else None for i in r["tags"]] for r in rows_of(dataset, "train")]
    assert decoded == [["a", "b"], [], []]
    assert [r["tags"] for r in rows_of(dataset, "eval")] == [[vocab.index("b") + 1, 0, 0]]  # c, zz unseen


@pytest.mark.parametrize("line,where", [
    ("u1,3,7,a,10,", "column 'rating', line 3: missing label"),
    ("u1,3,x7,a,10,4", "column 'count'"),
    ("u1,3,7,a,10,NaN", "column 'rating', line 3: the label must be a finite number, got nan"),  # then transformed
    ("u1,3,7,a,inf,4", "column 'ts', line 3: not a finite time: inf"),
    ('"u1,3,7,a,10,4', "line 3: 1 field, expected 6; a quote opened in this row runs over the lines after it"),
])
def test_bad_rows_are_named(tmp_path, line, where):
    path = tmp_path / "bad.csv"
    path.write_text("user,item,count,genres,ts,rating\nu0,1,2,a,5,4\n" + line + "\nu2,1,2,a,6,4\n")
    with pytest.raises(DataError, match=where.replace("(", r"\(")):
        import_dataset(spec(path), tmp_path / "out")


def test_a_quote_never_closed_in_the_last_column_is_named_not_read_to_the_end(tmp_path):
    """Arrow reads the rest of the file into a last field whose quote never closes: a row
    of the right width, and every row after it gone. A quoted value over several lines
    that closes, and blank lines, import as before."""
    rows = ["rating,ts,user"] + [f"{i % 2},{i},u{i % 3}" for i in range(1, 13)]
    (tmp_path / "open.csv").write_text("\n".join(rows[:5] + ['1,5,"broken'] + rows[6:]) + "\n")
    closed = rows[:5] + ['1,5,"two', 'lines"', ""] + rows[6:] + [""]  # and blank lines
    (tmp_path / "closed.csv").write_text("\n".join(closed) + "\n")

    def spec_of(name: str) -> ImportSpec:
        return ImportSpec.from_dict({"input": {"files": [str(tmp_path / name)]}, "label": {"column": "rating"},
                                     "categorical": {"columns": ["user"]},
                                     "split": {"kind": "chronological", "time_column": "ts", "eval_fraction": 0.25}})

    with pytest.raises(DataError, match="open.csv, line 6: a quote opened in this row is never closed"):
        import_dataset(spec_of("open.csv"), tmp_path / "out")
    (tmp_path / "last.csv").write_text("\n".join(rows[:-2] + ['1,11,"broken', rows[-1]]))  # no last line break
    with pytest.raises(DataError, match="last.csv, line 12: a quote opened in this row is never closed"):
        import_dataset(spec_of("last.csv"), tmp_path / "out")
    dataset = import_dataset(spec_of("closed.csv"), tmp_path / "out")
    assert dataset.rows == {"train": 9, "eval": 3}


def test_a_value_that_is_not_utf8_is_named_by_line_and_column(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes(b"user,item,count,genres,ts,rating\nu0,1,2,a,5,4\nu1,1,2,caf\xe9,6,3\n")
    with pytest.raises(DataError, match=r"latin.csv, column 'genres', line 3: not UTF-8 text \(byte b'\\xe9'\)"):
        import_dataset(spec(path), tmp_path / "out")


def test_a_header_naming_a_column_twice_is_named(tmp_path):
    path = tmp_path / "twice.csv"
    path.write_text("user,item,count,genres,ts,rating,user\nu0,1,2,a,5,4,u9\n")
    with pytest.raises(DataError, match="twice.csv, line 1: the header names column 'user' twice"):
        import_dataset(spec(path), tmp_path / "out")


def test_a_named_column_the_file_lacks_is_named(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("user,item,count,genres,ts,rating\nu0,1,2,a,5,4\nu1,1,2,a,6,3\n")
    with pytest.raises(DataError, match="log.csv.*'nosuch'"):
        import_dataset(spec(path, label={"column": "nosuch"}), tmp_path / "out")
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_bad_labels_missing_files_and_bad_specs_are_named(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("user,item,count,genres,ts,rating\nu0,1,2,a,5,1\nu1,1,2,a,6,3\n")
    with pytest.raises(DataError, match="column 'rating', line 3: the label must be 0 or 1"):
        import_dataset(spec(path, label={"transform": ""}), tmp_path / "out")
    with pytest.raises(DataError, match="nothere.csv"):
        import_dataset(spec(tmp_path / "nothere.csv"), tmp_path / "out")
    with pytest.raises(SpecError, match="label.transform"):
        spec(path, label={"transform": "is good"})
    with pytest.raises(SpecError, match="unknown key 'split.kinds'"):
        spec(path, split={"kinds": "random"})
    for delimiter in (";;", '"', "\n"):
        with pytest.raises(SpecError, match="^input.delimiter: one character"):
            spec(path, input={"delimiter": delimiter})
    os.link(path, tmp_path / "linked.csv")
    for twice in (tmp_path / "." / "log.csv", tmp_path / "linked.csv"):
        with pytest.raises(DataError, match=r"named twice \(also as .*log.csv\)"):
            import_dataset(spec(path, input={"files": [str(path), str(twice)]}), tmp_path / "out")
    with pytest.raises(SpecError, match="'user' is both categorical and multivalued"):
        spec(path, multivalued={"columns": {"user": "|"}})
    for encoding, key, value in (("raw", "min_count", 5), ("hash", "max_rows", 100)):  # would be ignored
        with pytest.raises(SpecError, match=f"^categorical.{key}: it caps a vocabulary, and encoding = '{encoding}'"):
            spec(path, categorical={"encoding": encoding, key: value})


@pytest.mark.parametrize("names,format", [
    (["log.tsv"], "tsv"), (["day_*.TSV.gz"], "tsv"), (["log.tab.zst"], "tsv"), (["day_0", "day_1.tsv"], "tsv"),
    (["a.parquet", "s3://b/c.pq?region=eu-west-1"], "parquet"), (["log.csv", "day_0"], "csv"), (["day_*"], "csv"),
    (["log.tsv.GZ"], "csv"),  # not compressed as Arrow reads names: its suffix is .GZ, which says nothing
])
def test_a_spec_without_a_format_takes_the_one_the_files_names_say(names, format):
    given = ImportSpec.from_dict({"input": {"files": names}, "categorical": {"columns": ["user"]}})
    assert given.input.format == format
    assert ImportSpec.from_dict({"input": {"files": names, "format": "csv"},
                                 "categorical": {"columns": ["user"]}}).input.format == "csv"  # as given


def test_files_whose_names_say_two_formats_need_the_format_given(tmp_path):
    with pytest.raises(SpecError, match=r"^input.format: the files' names say tsv \(a.tsv\), csv \(b.csv\): give "):
        ImportSpec.from_dict({"input": {"files": ["a.tsv", "b.csv"]}, "categorical": {"columns": ["user"]}})
    path = tmp_path / "log.tsv"  # read as the tab-separated file its name says
    path.write_text("\t".join(HEADER.split(",")) + "".join(f"u{i}\t1\t{i}\ta\t{i}\t4\n" for i in range(8)))
    dataset = import_dataset(ImportSpec.from_dict({
        "input": {"files": [str(path)]}, "label": {"column": "rating", "transform": ">= 4"},
        "categorical": {"columns": ["user", "item"]}, "split": {"kind": "ordered", "eval_fraction": 0.25}}),
        tmp_path / "out")
    assert sorted(int(r["user"]) for r in rows_of(dataset, "train")) == list(range(1, 7))


def test_a_split_left_empty_names_the_input_files(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("user,item,count,genres,ts,rating\nu0,1,2,a,5,4\n")
    with pytest.raises(DataError, match=f"file {path}: 1 rows: too few to split"):
        import_dataset(spec(path), tmp_path / "out")
    path.write_text("user,item,count,genres,ts,rating\nu0,1,2,a,5,4\nu1,1,2,a,6,3\nu2,1,2,a,7,3\n")
    with pytest.raises(DataError, match=f"^file {path}: the eval split is empty"):
        import_dataset(spec(path, split={"kind": "random", "eval_fraction": 0.01}), tmp_path / "out")


def test_dense_text_is_read_as_arrow_reads_numbers_and_booleans(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("user,item,count,genres,ts,rating\nu0,1,true,a,5,4\nu1,1, 7 ,a,6,3\nu2,1,  ,a,7,3\n"
                    "u3,1,FALSE,a,8,5\n")
    dataset = import_dataset(spec(path, dense={"transform": "none", "fill": -1.0},
                                  split={"kind": "ordered", "eval_fraction": 0.25}), tmp_path / "out")
    assert [r["count"] for r in rows_of(dataset, "train")] == [1.0, 7.0, -1.0]  # "  " is missing
    assert [r["count"] for r in rows_of(dataset, "eval")] == [0.0]


def test_a_label_whole_in_the_first_blocks_may_be_fractional_in_a_later_one(tmp_path, monkeypatch):
    monkeypatch.setattr("neorec.ingest.sources.BLOCK_BYTES", 256)  # blocks of a few rows
    path = tmp_path / "log.csv"
    ratings = ["4", "3"] * 30
    ratings[41], ratings[50] = "4.5", "3.5"  # type inference on the first block alone says int64
    path.write_text("user,item,count,genres,ts,rating\n"
                    + "\n".join(f"u{i},1,{i},a,{i},{r}" for i, r in enumerate(ratings)) + "\n")
    dataset = import_dataset(spec(path, split={"kind": "ordered", "eval_fraction": 0.1}), tmp_path / "out")
    labels = [r["label"] for split in ("train", "eval") for r in rows_of(dataset, split)]
    assert labels == [float(float(r) >= 4) for r in ratings]


def test_a_value_that_is_not_a_number_is_named_by_its_row_in_a_later_block(tmp_path, monkeypatch):
    monkeypatch.setattr("neorec.ingest.sources.BLOCK_BYTES", 256)  # blocks of a few rows
    path = tmp_path / "log.csv"
    lines = [f"u{i},1,{i},a,{i},4" for i in range(60)]
    lines[41] = "u41,1,4x,a,41,4"
    path.write_text("user,item,count,genres,ts,rating\n" + "\n".join(lines) + "\n")
    with pytest.raises(DataError, match="column 'count', line 43: a dense column must hold numbers, got '4x'"):
        import_dataset(spec(path), tmp_path / "out")



def _split_by(times: list[str], tmp_path: Path, name: str) -> tuple[list[int], list[int]]:
    """The rows (0-based, in the file) of each split, train then eval, when a log whose ``ts``
    column holds ``times`` is split chronologically, a quarter to eval."""
    path = tmp_path / f"{name}.csv"
    path.write_text("user,item,count,genres,ts,rating\n"
                    + "\n".join(f"u{i},1,{i},a,{t},4" for i, t in enumerate(times)) + "\n")
    dataset = import_dataset(spec(path, dense={"transform": "none"}), tmp_path / name)
    train, eval_ = ([int(r["count"]) for r in rows_of(dataset, split)] for split in ("train", "eval"))
    return sorted(train), sorted(eval_)


LATEST_QUARTER_FIRST = (list(range(15, 60)), list(range(15)))
"""60 rows, the later a row the earlier its time: the first 15 rows are eval."""


def test_a_time_column_whole_in_the_first_blocks_may_be_fractional_in_a_later_one(tmp_path, monkeypatch):
    monkeypatch.setattr("neorec.ingest.sources.BLOCK_BYTES", 256)  # blocks of a few rows
    times = [str(1000 - i) for i in range(60)]
    times[45] = "1.5"  # the earliest; type inference on the first block alone says int64
    assert _split_by(times, tmp_path, "fractional") == LATEST_QUARTER_FIRST


def test_iso_timestamps_read_as_text_order_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr("neorec.ingest.sources.BLOCK_BYTES", 256)
    naive = [f"2014-10-{21 + i // 24:02d} {i % 24:02d}:00:00" for i in reversed(range(60))]
    assert _split_by(naive, tmp_path, "naive") == LATEST_QUARTER_FIRST
    offset = [f"2014-10-21T{i // 4:02d}:{15 * (i % 4):02d}:00+01:00" for i in reversed(range(60))]
    assert _split_by(offset, tmp_path, "offset") == LATEST_QUARTER_FIRST


def test_a_time_that_is_not_one_is_named_by_its_row(tmp_path, monkeypatch):
    monkeypatch.setattr("neorec.ingest.sources.BLOCK_BYTES", 256)
    times = [f"2014-10-21 {i % 24:02d}:00:00" for i in range(60)]
    times[41] = "yesterday"
    path = tmp_path / "log.csv"
    path.write_text("user,item,count,genres,ts,rating\n"
                    + "\n".join(f"u{i},1,{i},a,{t},4" for i, t in enumerate(times)) + "\n")
    with pytest.raises(DataError, match="column 'ts', line 43: not a time like the column's first .*'yesterday'"):
        import_dataset(spec(path), tmp_path / "out")


HEADER = "user,item,count,genres,ts,rating\n"


@pytest.mark.parametrize("later,kind", [("2014-10-21T05:00:00+01:00", "timestamps with an offset"),
                                         ("1413867600", "numbers")])
def test_times_of_another_kind_in_a_later_file_are_refused_by_their_line(tmp_path, later, kind):
    """A file of timestamps without an offset, then one whose times have an offset (or are
    numbers): in no time zone, the first order against the others only by a guess."""
    first, second = tmp_path / "day_0.csv", tmp_path / "day_1.csv"
    first.write_text(HEADER + "".join(f"u{i},1,{i},a,2014-10-21 {i:02d}:00:00,4\n" for i in range(20)))
    second.write_text(HEADER + "".join(f"u{i},1,{i},a,{later},4\n" for i in range(20)))
    with pytest.raises(DataError, match=rf"^file {re.escape(str(second))}, column 'ts', line 2: times are {kind} "
                                        rf"here, timestamps without an offset in {re.escape(str(first))}: a "
                                        rf"chronological split orders times of one kind"):
        import_dataset(spec(tmp_path / "day_*.csv"), tmp_path / "out")


def test_typed_times_of_another_kind_in_a_later_parquet_file_are_refused(tmp_path):
    """Parquet's typed columns: seconds as numbers in one file, timestamps in the next."""
    columns = {"user": [f"u{i}" for i in range(20)], "item": ["1"] * 20, "count": [1.0] * 20,
               "genres": ["a"] * 20, "rating": [4] * 20}
    pq.write_table(pa.table({**columns, "ts": pa.array(range(20), pa.int64())}), tmp_path / "day_0.parquet")
    pq.write_table(pa.table({**columns, "ts": pa.array(range(20), pa.timestamp("s"))}), tmp_path / "day_1.parquet")
    with pytest.raises(DataError, match=r"day_1.parquet, column 'ts', row 1: times are timestamps without an offset "
                                        r"here, numbers in .*day_0.parquet"):
        import_dataset(spec(tmp_path / "day_*.parquet"), tmp_path / "out")


@pytest.mark.parametrize("transform,count,problem", [
    ("none", "1" + "0" * 40, "not a finite float32: 1e+40 is beyond float32's range"),
    ("standardize", "1e200", "values too large to standardize: their squares sum beyond float64's range"),
])
def test_a_dense_value_beyond_float32_is_refused_by_its_line(tmp_path, transform, count, problem):
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "u0,1,2,a,5,4\n" + f"u1,1,{count},a,6,4\n" + "u2,1,2,a,7,3\n" * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's overflow warnings: none
        with pytest.raises(DataError, match=f"^file {path}, column 'count', line 3: {re.escape(problem)}"):
            import_dataset(spec(path, dense={"transform": transform}), tmp_path / "out")


def test_a_dense_value_beyond_float32_imports_once_log1p_brings_it_within(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(HEADER + "u0,1,1e40,a,5,4\n" + "u2,1,2,a,7,3\n" * 4)
    dataset = import_dataset(spec(path, dense={"transform": "log1p"}, split={"kind": "ordered"}), tmp_path / "out")
    assert rows_of(dataset, "train")[0]["count"] == pytest.approx(math.log1p(1e40))


@pytest.mark.parametrize("spelling", ["NA", "null", "N/A", "NaN", "NULL", "#N/A", "nan", "-NaN"])
def test_only_an_empty_field_is_missing(tmp_path, spelling):
    """Arrow's other spellings of a missing value are values: a category of their own, and
    not a number in a dense column (named as such); an empty field is missing."""
    path = tmp_path / "log.csv"
    path.write_text(HEADER + f"{spelling},1,2,a,5,4\n,1,2,a,6,4\nu1,1,2,a,7,3\nu1,1,2,a,8,3\n")
    dataset = import_dataset(spec(path, split={"kind": "ordered"}), tmp_path / "out")
    vocabulary = pq.read_table(tmp_path / "out" / "vocab" / "user.parquet")["value"].to_pylist()
    assert sorted(vocabulary) == sorted(["u1", spelling])
    assert [r["user"] for r in rows_of(dataset, "train")] == [vocabulary.index(spelling) + 1, 0,
                                                               vocabulary.index("u1") + 1]
    path.write_text(HEADER + f"u0,1,2,a,5,4\nu1,1,{spelling},a,6,4\nu1,1,,a,7,3\nu1,1,2,a,8,3\n")
    problem = "not a finite number" if spelling.lower().lstrip("-") == "nan" else \
        f"a dense column must hold numbers, got '{spelling}' (only an empty field is a missing value)"
    with pytest.raises(DataError, match=f"column 'count', line 3: {re.escape(problem)}$"):
        import_dataset(spec(path), tmp_path / "out2")


@pytest.mark.parametrize("bad,where", [
    ("u1,1,x7,a,6,4", "column 'count', line 6: a dense column must hold numbers"),
    ("u1,1,7,a,6,4,extra", "line 6: 7 fields, expected 6"),
])
def test_a_value_error_and_a_width_error_name_the_same_line(tmp_path, bad, where):
    """Blank lines and a quoted line break before the bad row: both errors name the line
    ``sed -n Np`` shows."""
    path = tmp_path / "log.csv"
    text = HEADER + '\n"u0\nstill u0",1,2,a,5,4\n\n' + bad + "\n" + "u2,1,2,a,7,3\n" * 3
    path.write_text(text)
    assert text.splitlines()[5] == bad
    with pytest.raises(DataError, match=f"^file {path}, {re.escape(where)}"):
        import_dataset(spec(path), tmp_path / "out")
