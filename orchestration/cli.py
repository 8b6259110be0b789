"""The ``neorec`` command: data generation and conversion, training, evaluation, benchmarks
(the service commands are in :mod:`neorec.orchestration.cli_services`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from neorec.common.durable import write_durably
from neorec.common.errors import ConfigError, PathError, UserError, user_paths
from neorec.ingest.staging import staged_output
from neorec.orchestration.cli_args import add_client_security, at_least, client_security, port, seconds
from neorec.orchestration.progress import LazyBar
from neorec.orchestration.nodes import add_node_arguments, nodes_from_args, uses_torchrun
from neorec.orchestration.processes import USER_ERROR, rank_stopped_by_user_error, record_rank_exit
from neorec.orchestration.supervisor import die_with_parent

if TYPE_CHECKING:
    from neorec.orchestration.trainer_status import TrainerStatusServer
    from neorec.trainer.config import TrainConfig
    from neorec.trainer.distributed import DistributedContext

log = logging.getLogger("neorec")


INTERRUPTED = 130
BAD_ARGUMENTS = 1
"""``neorec status``'s exit status for bad arguments (grpc_health_probe's)."""
OVERWRITE_HELP = "replace what --out holds (the old dataset stays until the new one is complete)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run a ``neorec`` command. A user error (:class:`~neorec.common.errors.UserError`: bad
    configuration, data, arguments, a file the user named that cannot be read or written, a
    service that refuses) is one line on stderr and exit status 2; Ctrl-C is one line and
    130 from the moment ``main`` runs, the commands' modules (torch, Numba, gRPC) being
    imported inside it (this module's own imports take a few tens of milliseconds);
    anything else is a bug: it keeps its traceback and exits 1. A rank under
    ``neorec train --nproc`` leaves its status for that command to report; a rank whose
    collective failed because another rank stopped with a user error says so in one line
    and exits 2 too."""
    code = _command(argv)
    record_rank_exit(code)
    return code


def _command(argv: Sequence[str] | None) -> int:
    try:
        die_with_parent()
        args = _parser().parse_args(argv)
        # neorec's own lines from INFO, other libraries' from WARNING (torch logs INFO lines at exit)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        log.setLevel(logging.INFO)
        return args.run(args)
    except KeyboardInterrupt:
        print("neorec: interrupted", file=sys.stderr)
        return INTERRUPTED
    except UserError as err:
        print(f"neorec: error: {_one_line(err)}", file=sys.stderr)
        return USER_ERROR
    except RuntimeError:  # a collective that failed because another rank left
        peer = rank_stopped_by_user_error()
        if peer is None:
            raise
        print(f"neorec: rank {os.environ.get('RANK')} stopped with rank {peer}, whose error is above", file=sys.stderr)
        return USER_ERROR


def _one_line(err: UserError) -> str:
    return " ".join(str(err).split("\n")) or type(err).__name__


def _parser() -> argparse.ArgumentParser:
    from neorec.ingest.presets import PRESETS
    from neorec.orchestration.cli_services import add_service_commands

    parser = argparse.ArgumentParser(prog="neorec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

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
    importer.add_argument("spec", nargs="?", help="import spec (TOML; see ingest/import_spec.py)")
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
    convert.add_argument("--eval-fraction", type=float, default=0.1,
                         help="the newest rows that form the eval split")
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

    add_service_commands(commands)

    train = commands.add_parser("train", help="train a DLRM as a config says")
    train.add_argument("config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    train.add_argument("--ingest", metavar="HOST:PORT,...",
                       help="read through these reader services instead of in process")
    train.add_argument("--nproc", type=at_least(1), default=1,
                       help="trainer processes on this machine (torchrun; tables sharded by the planner)")
    add_node_arguments(train)
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run already in run.dir (its files only)")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its newest complete checkpoint (same epoch, step, next "
                            "batch and RNG); RUN_DIR becomes run.dir")
    train.add_argument("--status-port", type=port,
                       help="rank 0 serves grpc.health.v1 and its progress (neorec status) on this port (0: any)")
    train.add_argument("--status-host", default="127.0.0.1", help="where --status-port binds")
    train.add_argument("--follow", action="store_true",
                       help="follow the dataset's partitions as they land (data.follow; see docs/continuous.md)")
    train.add_argument("--idle-exit", type=seconds, metavar="SECONDS",
                       help="following: stop after this long without a new partition (data.idle_exit_s)")
    train.set_defaults(run=_train)

    launch = commands.add_parser("launch", help="run a whole job on this host: reader services, trainers, supervised")
    launch.add_argument("config", help="a training config with a [launch] section")
    launch.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    launch.add_argument("--overwrite", action="store_true",
                        help="replace the run already in run.dir (with --emit: the manifests already in DIR)")
    launch.add_argument("--resume", action="store_true", help="continue the run in run.dir from its checkpoint")
    launch.add_argument("--emit", nargs=2, metavar=("k8s", "DIR"),
                        help="write Kubernetes manifests for the job's roles into DIR instead of running it")
    launch.add_argument("--image", default="neorec:latest", help="with --emit k8s: the container image")
    launch.set_defaults(run=_launch)

    status = commands.add_parser("status", help="probe services like grpc_health_probe (exit 0 serving, 1 bad "
                                                "arguments, 2 connect failure, 3 RPC failure, 4 not serving)")
    status.add_argument("targets", nargs="+", metavar="HOST:PORT|RUN_DIR",
                        help="service addresses, or a `neorec launch` run directory")
    status.add_argument("--json", action="store_true", help="print every service's Status counters as JSON")
    status.add_argument("--timeout", type=seconds, default=1.0, help="seconds to connect and to answer")
    add_client_security(status)
    status.set_defaults(run=_status)
    status.error = lambda message: status.exit(BAD_ARGUMENTS, f"{status.prog}: error: {message}\n")  # as grpc_health_probe

    plan = commands.add_parser("plan", help="print the sharding plan for a config, without training")
    plan.add_argument("config")
    plan.add_argument("--world-size", type=at_least(1), required=True)
    plan.add_argument("--ranks-per-node", type=at_least(1), help="default: the config's sharding.ranks_per_node")
    plan.add_argument("--memory-per-rank", help="e.g. 16GiB (default: the config's sharding.memory_per_rank)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--json", help="also write the plan to this file")
    plan.set_defaults(run=_plan)

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on the eval split")
    evaluate.add_argument("config", nargs="?", help="default: the config saved with the checkpoint")
    evaluate.add_argument("--checkpoint", required=True,
                          help="a run directory, its checkpoint directory, or one checkpoint (default: the newest)")
    evaluate.add_argument("--best", action="store_true",
                          help="the run's checkpoint of the best eval AUC (checkpoint.keep_best)")
    evaluate.add_argument("--ingest", metavar="HOST:PORT,...",
                          help="read the eval split through these reader services (default: in process, whatever "
                               "the run read through)")
    evaluate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    evaluate.set_defaults(run=_eval)

    report = commands.add_parser("report", help="plot runs' loss, eval AUC/log loss and QPS (PNG) and summarise")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", help="where the PNGs go (default: the first run directory's report/)")
    report.set_defaults(run=_report)

    checkpoints = commands.add_parser("checkpoint", help="checkpoints of a run").add_subparsers(
        dest="checkpoint", required=True)
    inspect = checkpoints.add_parser("inspect", help="list a run's checkpoints: chains, bytes, bits, touched rows")
    inspect.add_argument("directory", help="a run directory or its checkpoint directory")
    inspect.add_argument("--verify", action="store_true",
                         help="also check every file's size and SHA-256, and each checkpoint's chain (exit 2 when "
                              "one cannot be restored)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(run=_checkpoint_inspect)

    bench = commands.add_parser("bench", help="benchmarks: ours against a baseline, side by side")
    bench.add_argument("name", choices=("train", "tbe", "ingest", "collectives", "checkpoint", "store", "import",
                                        "follow", "dynamic"))
    bench.add_argument("--json", help="write the results to this file")
    bench.add_argument("--quick", action="store_true", help="a small, fast configuration (for smoke tests)")
    bench.add_argument("--threads", type=at_least(0), default=0,
                       help="tbe: threads for ours and the baseline alike (1: the per-core comparison; 0: all cores)")
    bench.add_argument("--nproc", type=int, default=1,
                       help="train: compare N sharded trainer processes with one process; "
                            "collectives: ranks (at least 2)")
    bench.add_argument("--contend", action="store_true",
                       help="train: the demo's step quiet and beside one competing CPU-bound process")
    bench.set_defaults(run=_bench)
    return parser


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

    raw = read_toml(args.spec, "import spec") if args.spec else {}
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
    from neorec.ingest.schema import Dataset
    from neorec.ingest.verify import verify_dataset

    with user_paths():
        dataset = Dataset.load(args.dataset)
        with LazyBar(unit="rows", desc=f"verify {args.dataset}", unit_scale=True) as bar:
            reports = verify_dataset(dataset, progress=bar.update)
    for report in reports:
        print(f"{report.split}: {counted(report.files, 'file')}, {counted(report.row_groups, 'row group')}, "
              f"{counted(report.rows, 'row')}, {counted(len(report.problems), 'problem')}")
    problems = [problem for report in reports for problem in report.problems]
    for problem in problems:
        print(f"neorec: {_one_line(problem)}", file=sys.stderr)
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


def _train(args: argparse.Namespace) -> int:
    from neorec.orchestration.config import load_config
    from neorec.orchestration.processes import run_torchrun
    from neorec.trainer.distributed import init_from_torchrun, launched_by_torchrun, shutdown, single_process

    args.set = args.set + (["data.follow=true"] if args.follow else []) + (
        [f"data.idle_exit_s={args.idle_exit}"] if args.idle_exit is not None else [])
    overrides = list(args.set)
    if args.ingest:
        overrides.append(f"data.ingest={json.dumps(args.ingest.split(','))}")
    if args.resume:
        if args.overwrite:
            raise ConfigError("--resume continues a run, --overwrite replaces it: give one of them")
        overrides.append(f"run.dir={json.dumps(args.resume)}")
    config = load_config(args.config, overrides)
    try:
        nodes = nodes_from_args(args)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if uses_torchrun(args.nproc, nodes) and not launched_by_torchrun():
        from neorec.ingest.schema import Dataset
        from neorec.trainer.run.warmup import compile_kernels

        Dataset.load(config.data.path)  # a wrong path named once, before the ranks start
        compile_kernels(config)  # the ranks then load Numba's cache instead of racing to write it
        flags = (["--overwrite"] if args.overwrite else []) + (["--resume", args.resume] if args.resume else [])
        if args.status_port is not None:
            flags += ["--status-port", str(args.status_port), "--status-host", args.status_host]
        return run_torchrun(args.nproc, ["train", args.config, *[a for o in args.set for a in ("--set", o)],
                                         *(["--ingest", args.ingest] if args.ingest else []), *flags], nodes)
    loop = config.train
    context = (init_from_torchrun(loop.device, loop.collective_timeout_s) if launched_by_torchrun()
               else single_process(loop.device))
    status = None
    if args.status_port is not None and context.is_main:
        from neorec.common.transport import ServerSecurity, read_token
        from neorec.orchestration.trainer_status import TrainerStatusServer

        status = TrainerStatusServer(args.status_host, args.status_port, context.world_size,
                                     ServerSecurity(token=read_token(None)))
        status.start()
    try:
        summary = _train_rank(config, context, args.overwrite, bool(args.resume), status)
    except UserError:
        record_rank_exit(USER_ERROR)  # before the process group goes: the other ranks' collectives fail then
        raise
    finally:
        if status is not None:
            status.stop()
        shutdown(context)
    if context.is_main:
        print(json.dumps(summary, indent=2, sort_keys=True))
        line = f"eval AUC {summary['eval_auc']:.4f}" if "eval_auc" in summary else "no evaluation"
        if summary.get("oracle_auc") is not None:
            line += f" (oracle {summary['oracle_auc']:.4f}, gap {summary['oracle_auc'] - summary['eval_auc']:.4f})"
        if config.data.follow:
            line += f" (progressive, partition {summary['eval_partition'] or '-'})"
        print(f"{line}; run directory {config.run.dir}")
    return _exit_status(summary.get("stopped_by", ""))


def _exit_status(stopped_by: str) -> int:
    """0, or 128 + the signal's number for a run that a signal stopped (following
    partitions, a signal stops the run after a checkpoint): as an interrupted command exits,
    so that a supervisor (a Kubernetes Job, a shell) does not take it for a finished run."""
    return 128 + signal.Signals[stopped_by] if stopped_by in signal.Signals.__members__ else 0


def _train_rank(config: "TrainConfig", context: "DistributedContext", overwrite: bool, resume: bool,
                status: "TrainerStatusServer | None") -> dict:
    """Train this rank; rank 0 shows a progress bar (and feeds the status service)."""
    from neorec.trainer.run.step import StepReport
    from neorec.trainer.run.train import train

    if not context.is_main:
        return train(config, context=context, overwrite=overwrite, resume=resume)
    lazy = LazyBar(unit="step", desc="train")  # drawn at the first step: a refused run prints no bar

    def progress(report: StepReport) -> None:
        if status is not None:
            status.update(report)
        bar = lazy.update(0)
        if report.phase != "training":
            bar.set_postfix(waiting=f"after {report.partition or '-'}")
            return
        if bar.total != report.total_steps:
            bar.total = report.total_steps
        bar.update(1)
        bar.set_postfix(epoch=report.epoch, loss=f"{report.loss:.4g}", qps=f"{report.qps:,.0f}",
                        **({"partition": report.partition} if report.partition else {}), refresh=False)

    try:
        summary = train(config, progress=progress, context=context, overwrite=overwrite, resume=resume)
        if status is not None:
            status.done()
        return summary
    finally:
        lazy.close()


def _plan(args: argparse.Namespace) -> int:
    from neorec.ingest.schema import Dataset
    from neorec.orchestration.config import load_config
    from neorec.trainer.planner.from_config import planner_inputs
    from neorec.trainer.planner.planner import plan_tables, round_robin
    from neorec.trainer.planner.render import render

    overrides = list(args.set)
    if args.ranks_per_node is not None:
        overrides.append(f"sharding.ranks_per_node={args.ranks_per_node}")
    if args.memory_per_rank is not None:
        overrides.append(f"sharding.memory_per_rank={json.dumps(args.memory_per_rank)}")
    config = load_config(args.config, overrides)
    dataset = Dataset.load(config.data.path)
    specs, topo, constraints = planner_inputs(dataset, config, args.world_size)
    result = plan_tables(specs, topo, config.train.batch_size, constraints)
    print(render(result, round_robin(specs, topo, config.train.batch_size)))
    if args.json:
        with user_paths():
            Path(args.json).write_text(json.dumps(result.plan.to_dict(), indent=2) + "\n")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from neorec.orchestration.config import load_config
    from neorec.trainer.run.train import evaluate_checkpoint

    config = load_config(args.config, args.set) if args.config else None
    if config is None and args.set:
        raise ConfigError("--set changes a config file's values: give the config file too")
    with user_paths():
        metrics = evaluate_checkpoint(args.checkpoint, config, best=args.best,
                                      ingest=args.ingest.split(",") if args.ingest else ())
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


def _report(args: argparse.Namespace) -> int:
    from neorec.orchestration.report import write_report

    with user_paths():
        text, written = write_report(args.runs, args.out or Path(args.runs[0]) / "report")
    print(text)
    for path in written:
        print(f"wrote {path}")
    return 0


def _checkpoint_inspect(args: argparse.Namespace) -> int:
    from neorec.common.wording import counted
    from neorec.trainer.checkpoint.inspect import describe, render
    from neorec.trainer.checkpoint.layout import CheckpointError

    with user_paths():
        described = describe(args.directory, verify=args.verify)
    print(json.dumps(described, indent=2) if args.json else render(described))
    broken = [c["name"] for c in described["checkpoints"] if not c.get("verified", True)]
    if broken:
        raise CheckpointError(f"{counted(len(broken), 'checkpoint')} of {len(described['checkpoints'])} in "
                              f"{described['root']} cannot be restored: {', '.join(broken)}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from neorec.orchestration.config import load_config
    from neorec.orchestration.launch import Job, JobFailed

    if args.overwrite and args.resume:
        raise ConfigError("--resume continues a run, --overwrite replaces it: give one of them")
    config = load_config(args.config, args.set)
    if args.emit:
        from neorec.orchestration.k8s import write_manifests

        kind, directory = args.emit
        if kind != "k8s":
            raise ConfigError(f"--emit: only k8s is supported, got {kind!r}")
        with user_paths():
            written = write_manifests(config, args.config, directory, args.image, overwrite=args.overwrite,
                                      overrides=args.set)
        for path in written:
            print(path)
        return 0
    from neorec.ingest.schema import Dataset
    from neorec.trainer.run.run_dir import check_claim, lock

    with user_paths():  # before any service starts or anything is written
        Dataset.load(config.data.path)
        check_claim(config.run.dir, overwrite=args.overwrite, resume=args.resume)
        held = lock(config.run.dir)  # a job running in it (its trainer holds the lock) is refused here
        if held is not None:
            held.release()
    try:
        return Job(args.config, config, args.set, overwrite=args.overwrite, resume=args.resume).run()
    except JobFailed as err:
        print(f"neorec: error: job failed: {err}", file=sys.stderr)
        return err.status


def _status(args: argparse.Namespace) -> int:
    from neorec.common.addresses import check_address
    from neorec.orchestration.status import job_services, probe

    addresses: list[str] = []
    try:
        for target in args.targets:
            if Path(target).is_dir():
                addresses += job_services(target)
            else:
                check_address(target)
                addresses.append(target)
        security = client_security(args)
    except UserError as err:
        print(f"neorec: error: {_one_line(err)}", file=sys.stderr)
        return BAD_ARGUMENTS
    probes = [probe(a, security, args.timeout, with_status=args.json) for a in addresses]
    if args.json:
        print(json.dumps([{"address": p.address, "role": p.role, "code": p.code, "health": p.detail,
                           "status": p.status} for p in probes], indent=2))
    else:
        for p in probes:
            print(f"{p.address} {p.role or '?'}: {'SERVING' if p.code == 0 else p.detail}")
    return max(p.code for p in probes)


def _bench(args: argparse.Namespace) -> int:
    from neorec.benchmarks import run_benchmark

    if args.json:  # found before the benchmark runs, not after
        with user_paths():
            _check_writable_file(Path(args.json))
    results = run_benchmark(args.name, quick=args.quick, nproc=args.nproc, threads=args.threads,
                            contend=args.contend)
    text = json.dumps(results, indent=2, sort_keys=True)
    print(text)
    if results.get("table"):  # a table of per-partition curves (bench follow)
        print("\n".join(results["table"]))
    if args.json:
        with user_paths():
            write_durably(args.json, (text + "\n").encode())
    return 0


def _check_writable_file(path: Path) -> None:
    """A :class:`PathError` when ``path`` cannot be written as a file: a directory, or a
    directory above it that is missing or not writable."""
    if path.is_dir():
        raise PathError(f"{path} is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        raise PathError(f"{path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise PathError(f"{path}: {parent} is not writable")


if __name__ == "__main__":
    sys.exit(main())
