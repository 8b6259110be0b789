"""The ``neorec`` command: data generation and conversion, training, evaluation, benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from tqdm import tqdm

from ingest.arrow_memory import MEMORY_POOLS, SERVICE_MEMORY_POOL, use_memory_pool
from ingest.client import IngestError
from ingest.errors import DataError
from ingest.row_group_cache import DEFAULT_CAPACITY_BYTES
from trainer.config import ConfigError
from trainer.sharding.plan import PlanError

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.distributed import DistributedContext

log = logging.getLogger("neorec")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.run(args)
    except (ConfigError, DataError, IngestError, PlanError, FileNotFoundError) as err:
        print(f"neorec: error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neorec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="generate or convert datasets").add_subparsers(dest="data", required=True)
    synth = data.add_parser("synth", help="write a synthetic dataset with a planted teacher")
    synth.add_argument("--profile", choices=("criteo", "multihot"), default="criteo")
    synth.add_argument("--rows", type=int, required=True, help="train + eval rows")
    synth.add_argument("--out", required=True)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--eval-fraction", type=float, default=0.2)
    synth.set_defaults(run=_synth)
    convert = data.add_parser("convert", help="convert public dataset files you downloaded")
    convert.add_argument("format", choices=("criteo",))
    convert.add_argument("files", nargs="+", help="Criteo Kaggle/Terabyte TSV files")
    convert.add_argument("--out", required=True)
    convert.add_argument("--eval-every", type=int, default=10, help="every N-th row goes to the eval split")
    convert.set_defaults(run=_convert)

    ingest = commands.add_parser("ingest", help="reader services").add_subparsers(dest="ingest", required=True)
    serve = ingest.add_parser("serve", help="run a reader service until SIGTERM/Ctrl-C")
    serve.add_argument("--port", type=int, default=0, help="0: a free port, printed once serving")
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind (loopback unless told otherwise, e.g. 0.0.0.0)")
    serve.add_argument("--worker-threads", "--workers-threads", dest="threads", type=int, default=2,
                       help="decode threads")
    serve.add_argument("--row-group-cache-mib", type=int, default=DEFAULT_CAPACITY_BYTES >> 20,
                       help="memory for row groups shared by concurrent reads of one epoch")
    serve.add_argument("--memory-pool", choices=sorted(MEMORY_POOLS), default=SERVICE_MEMORY_POOL,
                       help="Arrow's allocator in the service (see ingest/arrow_memory.py)")
    serve.add_argument("--grace", type=float, default=5.0, help="seconds open streams get to finish on shutdown")
    serve.set_defaults(run=_ingest_serve)
    status = ingest.add_parser("status", help="print a reader service's live counters")
    status.add_argument("address", help="host:port")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(run=_ingest_status)

    train = commands.add_parser("train", help="train a DLRM as a config says")
    train.add_argument("config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    train.add_argument("--ingest", metavar="HOST:PORT,...",
                       help="read through these reader services instead of in process")
    train.add_argument("--nproc", type=int, default=1,
                       help="trainer processes on this machine (torchrun; tables sharded by the planner)")
    train.set_defaults(run=_train)

    plan = commands.add_parser("plan", help="print the sharding plan for a config, without training")
    plan.add_argument("config")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--ranks-per-node", type=int, help="default: the config's sharding.ranks_per_node")
    plan.add_argument("--memory-per-rank", help="e.g. 16GiB (default: the config's sharding.memory_per_rank)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--json", help="also write the plan to this file")
    plan.set_defaults(run=_plan)

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on the config's eval split")
    evaluate.add_argument("config")
    evaluate.add_argument("--checkpoint", required=True)
    evaluate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    evaluate.set_defaults(run=_eval)

    bench = commands.add_parser("bench", help="benchmarks: ours against a baseline, side by side")
    bench.add_argument("name", choices=("train", "tbe", "ingest", "collectives"))
    bench.add_argument("--json", help="write the results to this file")
    bench.add_argument("--quick", action="store_true", help="a small, fast configuration (for smoke tests)")
    bench.add_argument("--nproc", type=int, default=1,
                       help="train: compare N sharded trainer processes with one process; "
                            "collectives: ranks (at least 2)")
    bench.set_defaults(run=_bench)
    return parser


def _synth(args: argparse.Namespace) -> int:
    from ingest.synth import SynthSpec, generate

    spec = SynthSpec(profile=args.profile, rows=args.rows, seed=args.seed, eval_fraction=args.eval_fraction)
    with tqdm(total=spec.rows, unit="rows", desc=f"synth {spec.profile}") as bar:
        dataset = generate(spec, args.out, progress=bar.update)
    print(json.dumps({"out": str(dataset.root), "rows": dataset.rows, "oracle": dataset.oracle}, indent=2))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from ingest.convert_criteo import ConvertOptions, convert

    with tqdm(unit="rows", desc="convert criteo") as bar:
        dataset = convert(args.files, args.out, ConvertOptions(eval_every=args.eval_every), progress=bar.update)
    print(json.dumps({"out": str(dataset.root), "rows": dataset.rows}, indent=2))
    return 0


def _ingest_serve(args: argparse.Namespace) -> int:
    from ingest.service import ReaderServer, serve_until_signal

    use_memory_pool(args.memory_pool)
    server = ReaderServer(host=args.host, port=args.port, threads=args.threads,
                          cache_bytes=args.row_group_cache_mib << 20)

    def ready(address: str) -> None:
        print(f"neorec ingest: serving on {address}", flush=True)

    serve_until_signal(server, args.grace, ready)
    return 0


def _ingest_status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from protos import ingest_pb2, ingest_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = ingest_pb2_grpc.ReaderStub(channel).Status(ingest_pb2.StatusRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"neorec: error: {args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
    return 0


def _train(args: argparse.Namespace) -> int:
    from orchestration.config import load_config
    from orchestration.processes import run_torchrun
    from trainer.distributed import SINGLE_PROCESS, init_from_torchrun, launched_by_torchrun, shutdown

    overrides = list(args.set)
    if args.ingest:
        overrides.append(f"data.ingest={json.dumps(args.ingest.split(','))}")
    config = load_config(args.config, overrides)
    if args.nproc < 1:
        raise ConfigError(f"--nproc: must be at least 1, got {args.nproc}")
    if args.nproc > 1 and not launched_by_torchrun():
        from trainer.warmup import compile_kernels

        compile_kernels()  # the ranks then load Numba's cache instead of racing to write it
        return run_torchrun(args.nproc, ["train", args.config, *[a for o in overrides for a in ("--set", o)]])
    context = init_from_torchrun() if launched_by_torchrun() else SINGLE_PROCESS
    try:
        summary = _train_rank(config, context)
    finally:
        shutdown(context)
    if context.is_main:
        print(json.dumps(summary, indent=2, sort_keys=True))
        line = f"eval AUC {summary['eval_auc']:.4f}"
        if summary.get("oracle_auc") is not None:
            line += f" (oracle {summary['oracle_auc']:.4f}, gap {summary['oracle_auc'] - summary['eval_auc']:.4f})"
        print(f"{line}; run directory {config.run.dir}")
    return 0


def _train_rank(config: "TrainConfig", context: "DistributedContext") -> dict:
    """Train this rank; rank 0 shows a progress bar."""
    from trainer.train import StepReport, train

    if not context.is_main:
        return train(config, context=context)
    bar = tqdm(unit="step", desc="train")

    def progress(report: StepReport) -> None:
        if bar.total != report.total_steps:
            bar.total = report.total_steps
        bar.update(1)
        bar.set_postfix(epoch=report.epoch, loss=f"{report.loss:.4f}", qps=f"{report.qps:,.0f}", refresh=False)

    try:
        return train(config, progress=progress, context=context)
    finally:
        bar.close()


def _plan(args: argparse.Namespace) -> int:
    from ingest.schema import Dataset
    from orchestration.config import load_config
    from trainer.planner.from_config import planner_inputs
    from trainer.planner.planner import plan_tables, round_robin
    from trainer.planner.render import render

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
        Path(args.json).write_text(json.dumps(result.plan.to_dict(), indent=2) + "\n")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from orchestration.config import load_config
    from trainer.train import evaluate_checkpoint

    config = load_config(args.config, args.set)
    print(json.dumps(evaluate_checkpoint(config, args.checkpoint), indent=2, sort_keys=True))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from benchmarks import run_benchmark

    results = run_benchmark(args.name, quick=args.quick, nproc=args.nproc)
    text = json.dumps(results, indent=2, sort_keys=True)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
