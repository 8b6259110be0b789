"""The ``neorec`` command: training, evaluation, launching, benchmarks (the data commands are
in :mod:`neorec.orchestration.cli_data`, the service commands in
:mod:`neorec.orchestration.cli_services`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from neorec.common.durable import write_durably
from neorec.common.errors import ConfigError, PathError, UserError, user_paths
from neorec.orchestration.cli_args import (CommandParser, add_client_security, at_least, client_security, one_line,
                                           port, seconds, service_addresses)
from neorec.orchestration.progress import LazyBar
from neorec.orchestration.nodes import add_node_arguments, nodes_from_args, uses_torchrun
from neorec.orchestration.processes import (USER_ERROR, await_refusal_said, earlier_attempt_lasting_error,
                                            rank_stopped_by_user_error, record_lasting_error, record_rank_exit,
                                            refusal_said)
from neorec.orchestration.supervisor import die_with_parent

if TYPE_CHECKING:
    from neorec.orchestration.trainer_status import TrainerStatusServer
    from neorec.trainer.config import TrainConfig
    from neorec.trainer.distributed import DistributedContext

log = logging.getLogger("neorec")


INTERRUPTED = 130
OUTPUT_CLOSED = 141
"""The status of a command whose standard output was closed under it (``neorec … | head``):
a shell's for a process that SIGPIPE stopped."""
BAD_ARGUMENTS = 1
"""``neorec status``'s exit status for bad arguments (grpc_health_probe's)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run a ``neorec`` command. A user error (:class:`~neorec.common.errors.UserError`: bad
    configuration, data, arguments, a file the user named that cannot be read or written, a
    service that refuses) is one line on stderr and exit status 2; Ctrl-C is one line and
    130 from the moment ``main`` runs, the commands' modules (torch, Numba, gRPC) being
    imported inside it (this module's own imports take a few tens of milliseconds);
    anything else is a bug: it keeps its traceback and exits 1. A rank under
    ``neorec train --nproc`` leaves its status for that command to report; a rank whose
    collective failed because another rank stopped with a user error says so in one line
    and exits 2 too; ranks that ``--max-restarts`` starts again after a lasting error (a
    config's, data's: :attr:`~neorec.common.errors.UserError.lasting`) exit 2 at once, since
    they would meet it again."""
    earlier = earlier_attempt_lasting_error()
    if earlier is None:
        code = _command(argv)
    else:  # torchrun's --max-restarts started the ranks again after a lasting error: they would meet it again
        if os.environ.get("LOCAL_RANK") == "0":
            print(f"neorec: error: not started again: rank {earlier} stopped with an error above that a restart "
                  f"cannot mend", file=sys.stderr, flush=True)
            refusal_said()
        else:
            await_refusal_said()
        code = USER_ERROR
    record_rank_exit(code)
    return code


def _command(argv: Sequence[str] | None) -> int:
    try:
        die_with_parent()
        args = _parser().parse_args(argv)
        # neorec's own lines from INFO, other libraries' from WARNING (torch logs INFO lines at exit)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        log.setLevel(logging.INFO)
        code = args.run(args)
        sys.stdout.flush()  # output a pipe buffers fails here, where a closed reader is caught, not at exit
        return code
    except KeyboardInterrupt:
        print("neorec: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, sys.stdout.fileno())  # what is left to flush at exit goes nowhere
        os.close(nowhere)
        return OUTPUT_CLOSED
    except UserError as err:
        print(f"neorec: error: {one_line(err)}", file=sys.stderr)
        if err.lasting:
            record_lasting_error()
        return USER_ERROR
    except RuntimeError:  # a collective that failed because another rank left
        peer = rank_stopped_by_user_error()
        if peer is None:
            raise
        print(f"neorec: rank {os.environ.get('RANK')} stopped with rank {peer}, whose error is above", file=sys.stderr)
        return USER_ERROR


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (a broken pipe that is some
    other connection's is a defect, and keeps its traceback)."""
    try:
        output = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a caller's buffer)
        return False
    poll = select.poll()
    poll.register(output, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _parser() -> argparse.ArgumentParser:
    from neorec.orchestration.cli_data import add_data_commands
    from neorec.orchestration.cli_services import add_service_commands

    parser = CommandParser(prog="neorec", description="Train deep learning recommendation models: data, training, "
                           "evaluation, services, job launches and benchmarks.")
    commands = parser.add_subparsers(dest="command", required=True)

    add_data_commands(commands)
    add_service_commands(commands)

    train = commands.add_parser("train", help="train a DLRM as a config says")
    train.add_argument("config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    train.add_argument("--ingest", type=service_addresses, metavar="HOST:PORT,...",
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
    status.error_status = BAD_ARGUMENTS  # as grpc_health_probe

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
    evaluate.add_argument("--ingest", type=service_addresses, metavar="HOST:PORT,...",
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
    bench.add_argument("--nproc", type=at_least(1), default=1,
                       help="train: compare N sharded trainer processes with one process; "
                            "collectives: ranks (at least 2)")
    bench.add_argument("--contend", action="store_true",
                       help="train: the demo's step quiet and beside one competing CPU-bound process")
    bench.set_defaults(run=_bench)
    return parser


def _train(args: argparse.Namespace) -> int:
    from neorec.orchestration.config import load_config
    from neorec.orchestration.processes import run_torchrun
    from neorec.trainer.distributed import init_from_torchrun, launched_by_torchrun, shutdown, single_process

    args.set = args.set + (["data.follow=true"] if args.follow else []) + (
        [f"data.idle_exit_s={args.idle_exit}"] if args.idle_exit is not None else [])
    overrides = list(args.set)
    if args.ingest:
        overrides.append(f"data.ingest={json.dumps(args.ingest)}")
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
        from neorec.trainer.planner.from_config import check_before_ranks
        from neorec.trainer.run.warmup import compile_kernels

        check_before_ranks(Dataset.load(config.data.path), config, args.nproc * nodes.count, args.nproc)  # named once
        compile_kernels(config)  # the ranks then load Numba's cache instead of racing to write it
        flags = (["--overwrite"] if args.overwrite else []) + (["--resume", args.resume] if args.resume else [])
        if args.status_port is not None:
            flags += ["--status-port", str(args.status_port), "--status-host", args.status_host]
        return run_torchrun(args.nproc, ["train", args.config, *[a for o in args.set for a in ("--set", o)],
                                         *(["--ingest", ",".join(args.ingest)] if args.ingest else []), *flags], nodes)
    loop = config.train
    context = (init_from_torchrun(loop.device, loop.collective_timeout_s) if launched_by_torchrun()
               else single_process(loop.device))
    status = None
    if args.status_port is not None and context.is_main:
        from neorec.common.transport import ServerSecurity, read_token
        from neorec.orchestration.trainer_status import TrainerStatusServer

        status = TrainerStatusServer(args.status_host, args.status_port, context.world_size,
                                     ServerSecurity(token=read_token(config.security.token_file or None)))
        status.start()
        log.info("trainer status served on %s (neorec status %s)", status.host.address, status.host.address)
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
    if summary.get("stopped_by") == "blocked":  # its state is saved, but the data is not as promised
        if context.is_main:
            print(f"neorec: error: following stopped after data.idle_exit_s with ready partitions not trained: "
                  f"partition {summary['blocked_by']} was never marked ready, and partitions are trained in name "
                  f"order; mark it ready (or remove it) and continue with --resume {config.run.dir}", file=sys.stderr)
        record_rank_exit(USER_ERROR)
        record_lasting_error()  # a restart would wait data.idle_exit_s for the same partition
        return USER_ERROR
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
    from neorec.trainer.run.build import check_dynamic_plan

    overrides = list(args.set)
    if args.ranks_per_node is not None:
        overrides.append(f"sharding.ranks_per_node={args.ranks_per_node}")
    if args.memory_per_rank is not None:
        overrides.append(f"sharding.memory_per_rank={json.dumps(args.memory_per_rank)}")
    config = load_config(args.config, overrides)
    dataset = Dataset.load(config.data.path)
    specs, topo, constraints = planner_inputs(dataset, config, args.world_size)
    result = plan_tables(specs, topo, config.train.batch_size, constraints)
    if args.world_size > 1:
        check_dynamic_plan(result.plan, config.for_world(args.world_size))  # as the ranks would refuse it
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
                                      ingest=args.ingest or ())
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
    from neorec.common.transport import ClientSecurity, read_token

    with user_paths():
        token = read_token(config.security.token_file or None)  # the services' and the trainers' token
    try:
        return Job(args.config, config, args.set, overwrite=args.overwrite, resume=args.resume,
                   security=ClientSecurity(token=token)).run()
    except JobFailed as err:
        print(f"neorec: error: job failed: {err}", file=sys.stderr)
        return err.status


def _status(args: argparse.Namespace) -> int:
    from neorec.common.addresses import check_address
    from neorec.orchestration.status import job_services, probe

    addresses: list[str] = []
    try:
        for target in args.targets:
            found = job_services(target) if Path(target).is_dir() else [target]
            for address in found:
                check_address(address)
            addresses += found
        security = client_security(args)
    except UserError as err:
        print(f"neorec: error: {one_line(err)}", file=sys.stderr)
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

    for flag, given, benchmarks in (("--threads", args.threads != 0, ("tbe",)),
                                    ("--nproc", args.nproc != 1, ("train", "collectives")),
                                    ("--contend", args.contend, ("train",))):
        if given and args.name not in benchmarks:
            raise ConfigError(f"{flag} is for neorec bench {' and '.join(benchmarks)}, not {args.name}")
    if args.contend and args.nproc != 1:
        raise ConfigError("--contend measures one process beside a competing one: give it without --nproc")
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
