"""``neorec launch JOB.toml``: a whole training job on this host, supervised.

The job file is a training config with a ``[launch]`` section. The launcher starts the
reader services and, with ``store_service``, an embedding store service (each on a port it
picks, kept across restarts), waits until every one answers ``grpc.health.v1`` SERVING, records the job's addresses in
``RUN_DIR/services.json``, then starts the trainers (``neorec train --nproc N``, torchrun
underneath) pointed at the services, with trainer rank 0 serving its own health and Status.

It then watches every process, a tick every 0.25 s (an exit is noticed within it):

- a reader service that exits, or misses ``probe_misses`` health probes in a row (hung,
  e.g. SIGSTOP), is killed and restarted alone, on its port, after a backoff; the
  trainers ride it out (their client re-requests its batches from the others); a store
  service is restarted the same way, and the trainers, which stop when it goes, restart
  from the newest checkpoint (which holds their store tables);
- a trainer group that exits with a failure, stops answering its probe, or takes no step
  for ``trainer_stall_s``, is killed and restarted from the run's newest complete
  checkpoint (``--resume``; from scratch if there is none yet);
- a process gets ``startup_grace_s`` to come up before its probe counts;
- more failures than ``restarts`` (per service) or ``trainer_restarts`` end the job with
  exit status 1 and the first failure's error; a trainer's user error (status 2) ends it
  at once.

When the trainers finish, the services are stopped and the launcher exits 0. Ctrl-C or
SIGTERM stops everything (SIGTERM, then SIGKILL of whatever is left of each process tree)
within a few seconds and exits 130 or 143. Every line a process writes is echoed with its
role and index (``[ingest-1] …``) and kept in ``RUN_DIR/logs/``. One launcher a run
directory: it holds the lock of ``RUN_DIR/logs`` for the job's lifetime, so that a second
launch is refused before it starts a service or writes ``services.json``.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

import grpc

from neorec.common.durable import write_durably
from neorec.common.errors import ConfigError, describe, user_paths
from neorec.common.health import HealthProbe
from neorec.common.transport import ClientSecurity, bracketed
from neorec.orchestration.processes import USER_ERROR
from neorec.orchestration.status import SERVICES_FILE
from neorec.orchestration.supervisor import ManagedProcess
from neorec.protos import trainer_pb2, trainer_pb2_grpc
from neorec.trainer.checkpoint.layout import complete
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.run_dir import CHECKPOINTS, SUMMARY, lock

TICK_S = 0.25
STOP_GRACE_S = 3.0
INGEST_SERVICE = "neorec.ingest.Reader"
STORE_SERVICE = "neorec.store.Store"
STORE_SERVICE_DIR = "store-service"
"""The store service's tiers, under the run directory."""
TRAINER_SERVICE = "neorec.trainer.Trainer"
FINISHING_S = 120.0
"""How long trainers that wrote their run's summary may take to exit (rank 0's status
service stops first; the process groups, torchrun and the command end after it) before
missed probes count as a hang."""


class JobFailed(RuntimeError):
    """The job could not finish: a role failed more often than it may, or could not start;
    ``status`` is the launcher's exit status (2 when a process of the job refused the
    user's config or data, 1 otherwise)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def start_failure(name: str, code: int, last_lines: list[str]) -> JobFailed:
    """The failure of a job whose service ``name`` ended with ``code`` (negative: killed by
    that signal) before it answered SERVING: the launcher exits 2 when the service refused
    the user's config or data (its own status 2), else 1, whatever status the service had
    (0 when a SIGTERM stopped it, a signal's negative number)."""
    ended = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
    return JobFailed(f"{name} {ended} while starting: {said(last_lines)}",
                     status=USER_ERROR if code == USER_ERROR else 1)


def said(last_lines: list[str]) -> str:
    """What a process that ended said last, for the job's error: its ``neorec: error:``
    lines (the ranks' own, not the log lines around them), else its last three lines."""
    errors = [line for line in last_lines if line.startswith("neorec: error:")]
    return " / ".join(errors or last_lines[-3:])


def _signal_name(number: int) -> str:
    """``SIGKILL``, or ``signal 40`` for a number without a name (a real-time signal)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class Watched:
    """A process of the job and its supervision state."""

    process: ManagedProcess
    address: str
    probe: HealthProbe
    limit: int
    failures: int = 0
    restart_at: float | None = None
    """When a failed process is due to start again (None: it is running)."""
    failed_at: float | None = None
    """When it last failed (monotonic seconds)."""


class Job:
    """One launch of a job config (see the module docstring)."""

    def __init__(self, config_path: str, config: TrainConfig, overrides: Sequence[str], *, overwrite: bool = False,
                 resume: bool = False, echo: IO[str] = sys.stdout, security: ClientSecurity = ClientSecurity()) -> None:
        self.config = config
        self.launch = config.launch
        self.run_dir = Path(config.run.dir)
        self.echo = echo
        self.security = security
        self.logs = self.run_dir / "logs"
        self.first_failure: str | None = None
        self.stop_signal: int | None = None
        host = self.launch.host
        ports = free_ports(host, self.launch.ingest_workers + int(self.launch.store_service) + 1)
        python = [sys.executable, "-m", "neorec.orchestration.cli"]
        token_file = config.security.token_file
        tokens = ["--token-file", str(Path(token_file).resolve())] if token_file else []  # else $NEOREC_TOKEN, if set
        data_root = str(Path(config.data.path).resolve())
        self.services: list[Watched] = []
        """The reader services, then the store service (if the job has one)."""
        for index in range(self.launch.ingest_workers):
            address = f"{bracketed(host)}:{ports[index]}"
            command = [*python, "ingest", "serve", "--host", host, "--port", str(ports[index]), "--data-root",
                       data_root, "--worker-threads", str(self.launch.worker_threads), "--grace", "1", *tokens]
            process = ManagedProcess("ingest", index, command, self.logs / f"ingest-{index}.log", echo)
            self.services.append(Watched(process, address, self._probe(address, INGEST_SERVICE), self.launch.restarts))
        readers = [w.address for w in self.services]
        settings = [a for override in overrides for a in ("--set", override)]
        if self.launch.store_service:
            port = ports[self.launch.ingest_workers]
            address = f"{bracketed(host)}:{port}"
            command = [*python, "store", "serve", "--dir", str(self.run_dir / STORE_SERVICE_DIR), "--host", host,
                       "--port", str(port), "--grace", "1", "--data-root", str(self.run_dir),  # its checkpoints
                       *tokens]
            process = ManagedProcess("store", 0, command, self.logs / "store-0.log", echo)
            self.services.append(Watched(process, address, self._probe(address, STORE_SERVICE), self.launch.restarts))
            settings += ["--set", f"embedding_store.service='{address}'"]
        trainer_address = f"{bracketed(host)}:{ports[-1]}"
        command = [*python, "train", config_path, *settings, "--nproc", str(self.launch.nproc),
                   "--status-port", str(ports[-1]), "--status-host", host]
        if readers:
            command += ["--ingest", ",".join(readers)]
        self.trainer = Watched(ManagedProcess("trainer", 0, command, self.logs / "trainer.log", echo),
                               trainer_address, self._probe(trainer_address, TRAINER_SERVICE),
                               self.launch.trainer_restarts)
        self.trainer_status = trainer_pb2_grpc.TrainerStub(self.trainer.probe.channel)
        self._status_future: grpc.Future | None = None
        self._status_next = 0.0
        self.first_flags = ["--overwrite"] if overwrite else ["--resume", str(self.run_dir)] if resume else []

    def _probe(self, address: str, service: str) -> HealthProbe:
        return HealthProbe(self.security.channel(address), service, self.launch.probe_interval_s)

    # -------------------------------------------------------------------------- run
    def run(self) -> int:
        """Run the job to its end; returns the launcher's exit status."""
        with user_paths():  # run.dir under a file
            owner = lock(self.logs, what="job log directory", owners="a neorec launch")
        if self.first_flags == ["--overwrite"]:  # the replaced run's logs go with it
            for old in self.logs.glob("*.log"):
                old.unlink()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        started_cpu, started = time.process_time(), time.monotonic()
        try:
            if self.launch.ingest_workers:
                from neorec.ingest.chunks import compile_decoding

                compile_decoding()  # the reader services, started together, then load Numba's cache
            for service in self.services:
                service.process.start()
            if not self._await_services():
                self._say(f"stopped ({signal.Signals(self.stop_signal).name}) while the services started")
                return 128 + self.stop_signal
            self._write_services()
            self.trainer.process.start(self.first_flags)
            return self._supervise()
        except JobFailed as err:
            self._say(f"job failed: {err}")
            raise
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if owner is not None:
                owner.release()
            wall, cpu = time.monotonic() - started, time.process_time() - started_cpu
            self._say(f"launcher used {cpu:.2f} s of CPU over {wall:.1f} s ({100 * cpu / max(wall, 1e-9):.2f}% of a "
                      f"core)")

    def _on_signal(self, signum: int, frame) -> None:
        self.stop_signal = signum

    def _await_services(self) -> bool:
        """Wait for every service to answer SERVING; False when a signal came first."""
        deadline = time.monotonic() + self.launch.startup_grace_s
        while self.services and not all(w.probe.answered for w in self.services):
            if self.stop_signal is not None:
                return False
            for service in self.services:
                code = service.process.exit_code()
                if code is not None:
                    raise start_failure(service.process.name, code, service.process.last_lines)
                service.probe.tick(time.monotonic())
            if time.monotonic() > deadline:
                slow = [w.process.name for w in self.services if not w.probe.answered]
                raise JobFailed(f"{', '.join(slow)} did not answer SERVING within {self.launch.startup_grace_s:g} s")
            time.sleep(TICK_S)
        return True

    def _write_services(self) -> None:
        services: dict[str, list[str]] = {"ingest": []}
        for watched in (*self.services, self.trainer):
            services.setdefault(watched.process.role, []).append(watched.address)
        write_durably(self.run_dir / SERVICES_FILE, (json.dumps(services, indent=2) + "\n").encode())  # whole or old

    def _supervise(self) -> int:
        while True:
            if self.stop_signal is not None:
                self._say(f"stopping ({signal.Signals(self.stop_signal).name})")
                return 128 + self.stop_signal
            now = time.monotonic()
            for service in self.services:
                self._watch_service(service, now)
            code = self.trainer.process.exit_code()
            if code == 0:
                self._say("the trainers finished")
                return 0
            if code == USER_ERROR and not self._service_failed_under_trainer():
                raise JobFailed(f"the trainer refused the job: {said(self.trainer.process.last_lines)}",
                                status=USER_ERROR)
            self._watch_trainer(code, now)
            time.sleep(TICK_S)

    def _watch_service(self, service: Watched, now: float) -> None:
        process = service.process
        if service.restart_at is not None:
            if now >= service.restart_at:
                service.restart_at = None
                service.probe.reset()
                process.start()
            return
        code = process.exit_code()
        service.probe.tick(now)
        if code is not None:
            self._failed(service, f"{process.name} exited with status {code}", now)
        elif service.probe.misses >= self.launch.probe_misses and self._past_grace(service, now):
            self._failed(service, f"{process.name} missed {service.probe.misses} health probes ({service.probe.last_error})",
                         now)

    def _watch_trainer(self, code: int | None, now: float) -> None:
        trainer = self.trainer
        if trainer.restart_at is not None:
            if now >= trainer.restart_at:
                trainer.restart_at = None
                trainer.probe.reset()
                checkpoints = complete(self.run_dir / CHECKPOINTS)
                flags = ["--resume", str(self.run_dir)] if checkpoints else ["--overwrite"]
                self._say(f"restarting the trainers ({' '.join(flags)})")
                trainer.process.start(flags)
            return
        trainer.probe.tick(now)
        stalled = self._stalled_for(now)
        if code is not None:
            self._failed(trainer, f"the trainers exited with status {code}", now)
        elif trainer.probe.misses >= self.launch.probe_misses and self._past_grace(trainer, now) \
                and not self._finishing(now):
            self._failed(trainer, f"trainer rank 0 missed {trainer.probe.misses} health probes "
                                  f"({trainer.probe.last_error})", now)
        elif stalled is not None and stalled > self.launch.trainer_stall_s:
            self._failed(trainer, f"the trainers took no step for {stalled:.0f} s", now)

    def _finishing(self, now: float) -> bool:
        """Whether the trainers wrote the run's summary since they started, under
        :data:`FINISHING_S` ago: their ranks are ending, and their status service is gone
        before the command exits."""
        try:
            written = (self.run_dir / SUMMARY).stat().st_mtime
        except OSError:
            return False
        wall = time.time()
        started = wall - (now - self.trainer.process.started_at)
        return started <= written and wall - written < FINISHING_S

    def _service_failed_under_trainer(self) -> bool:
        """Whether a service failed since the trainers started: their error is its, and
        they are restarted, not the job refused (a store service's death ends the trainers)."""
        started = self.trainer.process.started_at
        return any(s.failed_at is not None and s.failed_at >= started for s in self.services)

    def _stalled_for(self, now: float) -> float | None:
        """Seconds since the trainers' last step, from rank 0's Status (None: unknown yet)."""
        if now < self._status_next:
            return None
        self._status_next = now + self.launch.probe_interval_s
        previous, self._status_future = self._status_future, self.trainer_status.Status.future(
            trainer_pb2.StatusRequest(), timeout=self.launch.probe_interval_s)
        if previous is None or not previous.done():
            return None
        try:
            reply = previous.result()
        except grpc.RpcError:
            return None
        return reply.seconds_since_step if reply.phase == "training" else None

    def _past_grace(self, watched: Watched, now: float) -> bool:
        return watched.probe.answered or now - watched.process.started_at > self.launch.startup_grace_s

    def _failed(self, watched: Watched, why: str, now: float) -> None:
        """Kill ``watched``'s process tree and schedule its restart, or end the job."""
        self.first_failure = self.first_failure or why
        watched.process.stop(grace_s=0.0)
        watched.failures += 1
        watched.failed_at = time.monotonic()
        if watched.failures > watched.limit:
            raise JobFailed(f"{why}; that is {watched.failures} failures of {watched.process.name} (at most "
                            f"{watched.limit} restarts); the first failure: {self.first_failure}")
        delay = min(self.launch.backoff_s * 2 ** (watched.failures - 1), self.launch.max_backoff_s)
        self._say(f"{why}; restarting it in {delay:g} s ({watched.failures} of {watched.limit} restarts)")
        watched.restart_at = now + delay

    def _stop_all(self) -> None:
        """Stop the trainers, then the services, each tree within a few seconds (a trainer's
        last checkpoint may still need its store service)."""
        self.trainer.process.stop(STOP_GRACE_S)
        stoppers = [threading.Thread(target=w.process.stop, args=(STOP_GRACE_S,)) for w in self.services]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join()
        for watched in (self.trainer, *self.services):
            watched.probe.cancel()
            watched.probe.channel.close()

    def _say(self, text: str) -> None:
        self.echo.write(f"[launch] {text}\n")
        self.echo.flush()


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now (bound, then released); a
    :class:`ConfigError` naming ``launch.host`` when it is no address of this host."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
    except OSError as err:  # socket.gaierror: a name that does not resolve
        raise ConfigError(f"launch.host: cannot listen on {host!r}: {describe(err)}") from None
    finally:
        for s in sockets:
            s.close()
    return ports
