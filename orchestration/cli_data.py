"""``neorec data``: generate, import, convert and verify datasets."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from neorec.common.errors import ConfigError, user_paths
from neorec.ingest.staging import staged_output
from neorec.orchestration.cli_args import at_least, one_line
from neorec.orchestration.progress import LazyBar

OVERWRITE_HELP = "replace what --out holds (the old dataset stays until the new one is complete)"


def add_data_commands(commands: "argparse._SubParsersAction") -> None:
    """The ``data`` command group."""
    from neorec.ingest.presets import PRESETS

    data = commands.add_parser("data", help="generate or convert datasets").add_subparsers(dest="data", required=True)
    synth = data.add_parser("synth", help="write a synthetic dataset with a planted teacher")
    synth.add_argument("--profile", choices=("criteo", "multihot"), default="criteo")
    synth.add_argument("--rows", type=at_least(2), required=True, help="train + eval rows")
    synth.add_argument("--out", required=True)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--eval-fraction", type=float, default=0.2)
    synth.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    synth.add_argument("--partitions", type=at_least(0), default=0,
                       help="write the rows as this many time partitions (partitions/NAME/ + _SUCCESS) instead of "
                            "train/eval splits")
    synth.add_argument("--drift", type=float, default=0.0,
                       help="with --partitions: quarter turns the planted teacher's id vectors rotate per partition")
    synth.add_argument("--raw-ids", action="store_true", help="raw 64-bit ids, for dynamic tables")
    synth.add_argument("--id-space", type=at_least(0), default=0,
                       help="ids each feature draws from (Zipf; default: the profile's cardinalities)")
    synth.set_defaults(run=_synth)
    importer = data.add_parser("import", help="import CSV/TSV/Parquet click logs (an import spec, or flags)")
    importer.add_argument("spec", nargs="?", help="import spec (TOML; see docs/data-import.md; with --partition, "
                                                  "default: the spec the dataset in --out was imported with)")
    importer.add_argument("--out", required=True)
    importer.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    importer.add_argument("--files", nargs="+", help="input files, globs or URIs (input.files)")
    importer.add_argument("--format", choices=("csv", "tsv", "parquet"), help="input.format")
    importer.add_argument("--label", help="the label column (label.column)")
    importer.add_argument("--label-transform", help="e.g. '>= 4' (label.transform)")
    importer.add_argument("--dense", help="comma-separated dense columns (dense.columns)")
    importer.add_argument("--categorical", help="comma-separated categorical columns (categorical.columns)")
    importer.add_argument("--multivalued", action="append", metavar="COLUMN=DELIMITER",
                          help="a multi-valued column and its delimiter ('' for a list column)")
    importer.add_argument("--split", choices=("chronological", "ordered", "random", "files"), help="split.kind")
    importer.add_argument("--time-column", help="split.time_column")
    importer.add_argument("--eval-fraction", type=float, help="split.eval_fraction")
    importer.add_argument("--vocab-from", metavar="DATASET",
                          help="encode with the vocabularies of this imported dataset (new data, same ids)")
    importer.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec key")
    importer.add_argument("--partition", metavar="NAME",
                          help="add the rows as time partition NAME of the dataset in --out, encoded with its "
                               "vocabularies (see docs/continuous.md)")
    importer.set_defaults(run=_import)
    convert = data.add_parser("convert", help="convert public dataset files you downloaded (importer presets)")
    convert.add_argument("format", choices=PRESETS)
    convert.add_argument("files", nargs="+",
                         help="criteo: TSV files (read in day order: day_2 before day_10); avazu: the train CSV; "
                              "movielens: its directory")
    convert.add_argument("--out", required=True)
    convert.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    convert.add_argument("--eval-fraction", type=float,
                         help="the newest rows that form the eval split (default 0.1)")
    convert.add_argument("--eval-files", nargs="+", default=[],
                         help="instead: the eval split is these files (some of FILES)")
    convert.add_argument("--min-count", type=at_least(1), default=1,
                         help="categorical values seen fewer times in the train split map to id 0")
    convert.add_argument("--hash-rows", type=at_least(0), default=0,
                         help="hash categoricals into this many rows instead of counting a vocabulary")
    convert.set_defaults(run=_convert)
    verify = data.add_parser("verify", help="read a whole dataset once, as training would, and name every bad row "
                                            "group (checksums, types, labels, values, ids)")
    verify.add_argument("dataset")
    verify.set_defaults(run=_verify)


def _synth(args: argparse.Namespace) -> int:
    from neorec.ingest.synth import SynthSpec, generate

    spec = SynthSpec(profile=args.profile, rows=args.rows, seed=args.seed, eval_fraction=args.eval_fraction,
                     partitions=args.partitions, drift=args.drift, raw_ids=args.raw_ids, id_space=args.id_space)
    with user_paths(), staged_output(args.out, args.overwrite) as staging, \
            LazyBar(total=spec.rows, unit="rows", desc=f"synth {spec.profile}") as bar:
        dataset = generate(spec, staging, progress=bar.update)
    if spec.partitions:
        from neorec.ingest.partitions import open_partition, partition_names

        described = {name: open_partition(Path(args.out), name).info for name in partition_names(Path(args.out))}
        print(json.dumps({"out": args.out, "partitions": described}, indent=2))
        return 0
    print(json.dumps({"out": args.out, "rows": dataset.rows, "oracle": dataset.oracle}, indent=2))
    return 0


def _import(args: argparse.Namespace) -> int:
    from neorec.ingest.import_spec import ImportSpec
    from neorec.orchestration.config import apply_override, read_toml

    if args.spec:
        raw = read_toml(args.spec, "import spec")
    elif args.partition is not None:  # the dataset's own spec, for the partition's --files
        from neorec.ingest.partition_import import recorded_spec

        with user_paths():
            raw = recorded_spec(args.out)
        if not args.files:
            raise ConfigError("--partition without an import spec: name the partition's files with --files")
    else:
        raw = {}
    flags = {"input.files": args.files, "input.format": args.format, "label.column": args.label,
             "label.transform": args.label_transform, "split.kind": args.split,
             "split.time_column": args.time_column, "split.eval_fraction": args.eval_fraction,
             "dense.columns": args.dense.split(",") if args.dense else None,
             "categorical.columns": args.categorical.split(",") if args.categorical else None,
             "multivalued.columns": dict(m.partition("=")[::2] for m in args.multivalued)
             if args.multivalued else None}
    for key, value in flags.items():
        if value is not None:
            section, name = key.split(".")
            raw.setdefault(section, {})[name] = value
    for override in args.set:
        apply_override(raw, override)
    try:
        spec = ImportSpec.from_dict(raw)
    except ValueError as err:
        raise ConfigError(f"{args.spec or 'import flags'}: {err}") from None
    if args.partition is not None:
        return _import_partition(spec, args)
    return _write_import(spec, None, args, "import")


def _import_partition(spec, args: argparse.Namespace) -> int:
    from neorec.ingest.partition_import import import_partition

    if args.vocab_from:
        raise ConfigError("--vocab-from and --partition: a partition is encoded with the vocabularies of the dataset "
                          "in --out")
    with user_paths(), LazyBar(unit="rows", desc=f"partition {args.partition} → {args.out}", unit_scale=True) as bar:
        info = import_partition(spec, args.out, args.partition, progress=bar.update)
    print(json.dumps({"out": args.out, "partition": args.partition, **info}, indent=2))
    for column, unseen in info["oov"].items():
        if unseen:
            print(f"neorec: {unseen:,} of {info['values'][column]:,} values of column {column!r} are not in its "
                  f"vocabulary: out-of-vocabulary id 0", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from neorec.ingest.presets import PresetOptions, preset

    spec, source = preset(args.format, args.files, PresetOptions(
        eval_fraction=args.eval_fraction, eval_files=tuple(args.eval_files), min_count=args.min_count,
        hash_rows=args.hash_rows))
    return _write_import(spec, source, args, args.format)


def _verify(args: argparse.Namespace) -> int:
    from neorec.common.wording import counted
    from neorec.ingest.errors import DataError
    from neorec.ingest.partitions import MARKER
    from neorec.ingest.schema import Dataset
    from neorec.ingest.verify import verify_dataset

    with user_paths():
        dataset = Dataset.load(args.dataset)
        with LazyBar(unit="rows", desc=f"verify {args.dataset}", unit_scale=True) as bar:
            reports = verify_dataset(dataset, progress=bar.update)
    for report in reports:
        if not report.ready:
            print(f"{report.split}: not marked ready ({MARKER}): not read (training waits for it)")
            continue
        print(f"{report.split}: {counted(report.files, 'file')}, {counted(report.row_groups, 'row group')}, "
              f"{counted(report.rows, 'row')}, {counted(len(report.problems), 'problem')}")
    problems = [problem for report in reports for problem in report.problems]
    for problem in problems:
        print(f"neorec: {one_line(problem)}", file=sys.stderr)
    if problems:
        raise DataError(f"{counted(len(problems), 'problem')} in {args.dataset}")
    return 0


def _write_import(spec, source, args: argparse.Namespace, profile: str) -> int:
    from neorec.ingest.importer import import_dataset

    vocab_from = getattr(args, "vocab_from", None)
    inputs = [*spec.input.files, *spec.split.eval_files, *(args.files or ()), *([vocab_from] if vocab_from else [])]
    with user_paths(), staged_output(args.out, args.overwrite, inputs) as staging, \
            LazyBar(unit="rows", desc=f"{profile} → {args.out}", unit_scale=True) as bar:
        dataset = import_dataset(spec, staging, source=source, vocab_from=vocab_from,
                                 progress=bar.update, profile=profile)
    print(json.dumps({"out": args.out, "rows": dataset.rows,
                      "tables": {f.table: f.cardinality for f in dataset.schema.sparse}}, indent=2))
    return 0
