"""``neorec launch`` and ``neorec status`` as a user runs them: a job of reader services and
trainers that finishes as a plain run does, restarts what fails, stops on Ctrl-C and leaves
no process or port behind; status exit codes as grpc_health_probe's."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from neorec.ingest.service import ReaderServer
from neorec.orchestration.k8s import manifests
from neorec.orchestration.launch import start_failure
from neorec.orchestration.config import load_config
from neorec.trainer.run.run_dir import lock
from tests.cli import NEOREC, neorec, neorec_in_process
from tests.ingest.workers import DATA_ROOTS, start_worker, stop_all
from tests.trainer.run_records import records
from tests.trainer.test_train import final_state, untimed

pytestmark = pytest.mark.usefixtures("demo_kernels")  # deadlines on first steps time training


# ----------------------------------------------------------------------- neorec status
@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_status_exit_codes_are_grpc_health_probe_s(tmp_path):
    live, stopped, dead = start_worker(), start_worker(), start_worker()
    dead.kill()
    draining = ReaderServer(data_roots=DATA_ROOTS)
    draining.start()
    draining.host.draining()  # health says NOT_SERVING, as during a graceful shutdown
    bare = grpc.server(ThreadPoolExecutor(1))  # a gRPC server without the health service
    bare_port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        stopped.process.send_signal(signal.SIGSTOP)
        assert neorec("status", live.address).returncode == 0
        assert neorec("status", dead.address).returncode == 2
        assert neorec("status", stopped.address, "--timeout", "1").returncode == 2
        assert neorec("status", f"127.0.0.1:{bare_port}").returncode == 3
        assert neorec("status", draining.address).returncode == 4
        assert neorec("status", "not-an-address").returncode == 1
        assert neorec("status").returncode == 1
        assert neorec("status", live.address, dead.address).returncode == 2  # the worst wins
        report = json.loads(neorec("status", live.address, "--json").stdout)
        assert report[0]["role"] == "ingest" and report[0]["code"] == 0 and "uptimeSeconds" in report[0]["status"]
    finally:
        stopped.process.send_signal(signal.SIGCONT)
        stop_all([live, stopped])
        draining.stop(grace_s=0.1)
        bare.stop(0)


# ----------------------------------------------------------------------- neorec launch
def job_file(tmp_path: Path, dataset, *, nproc: int = 1, workers: int = 2, **more: str) -> Path:
    """A job config: the demo model on the tests' dataset, checkpoints every 10 steps."""
    sections = {
        "data": {"path": f"'{dataset.root}'"},
        "model": {"max_table_rows": "3000"},
        "train": {"batch_size": "64", "epochs": "3", "log_every": "10", "collective_timeout_s": "10"},
        "checkpoint": {"every_steps": "10"},
        "run": {"dir": f"'{tmp_path / 'run'}'"},
        "launch": {"ingest_workers": str(workers), "nproc": str(nproc), "worker_threads": "1",
                   "startup_grace_s": "60", "trainer_stall_s": "20", "backoff_s": "0.2"},
    }
    for key, value in more.items():
        section, name = key.split("__")
        sections.setdefault(section, {})[name] = value
    text = Path("configs/demo.toml").read_text()
    for section in sections:
        text = _drop_section(text, section)
    text += "".join(f"\n[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()) for s, keys in sections.items())
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def _drop_section(text: str, section: str) -> str:
    """``text`` (TOML) without the ``[section]`` table."""
    lines, keep, out = text.splitlines(), True, []
    for line in lines:
        if line.startswith("["):
            keep = line.strip() != f"[{section}]"
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def job_processes(job: Path) -> list[int]:
    """Processes still alive that a launch of ``job`` started (their command names it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_text()
            environ = (proc / "environ").read_text()
        except OSError:
            continue
        if "NEOREC_DIE_WITH_PARENT=1" in environ and (str(job) in command or str(job.parent) in command):
            found.append(int(proc.name))
    return found


def assert_ports_free(run: Path) -> None:
    services = json.loads((run / "services.json").read_text())
    for address in (a for addresses in services.values() for a in addresses):
        host, port = address.rsplit(":", 1)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger
            probe.bind((host, int(port)))  # raises while a process of the job still listens on it


@pytest.mark.slow  # end to end, over 10 s: CI runs it with -m slow
def test_a_launched_job_trains_as_a_plain_run_and_leaves_nothing(criteo_dataset, tmp_path):
    job = job_file(tmp_path, criteo_dataset)
    result = neorec("launch", str(job))
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = tmp_path / "run"
    assert "[ingest-0]" in result.stdout and "[trainer-0]" in result.stdout and "[launch] the trainers finished" \
        in result.stdout
    assert (run / "logs" / "trainer.log").read_text() and (run / "logs" / "ingest-1.log").read_text()
    plain = neorec("train", str(job), "--set", f"run.dir='{tmp_path / 'plain'}'")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert untimed(json.loads((run / "summary.json").read_text())) == \
        untimed(json.loads((tmp_path / "plain" / "summary.json").read_text()))
    assert job_processes(job) == []
    assert_ports_free(run)


@pytest.mark.slow  # a launched job of two ranks, ~30 s
def test_ranks_that_finished_are_not_taken_for_hung_while_they_exit(criteo_dataset, tmp_path):
    """Rank 0's status service stops before the ranks' process group, torchrun and the
    command end: the missed probes of a run that wrote its summary are no hang (two missed
    in a row count here: 2 s of silence, seconds shorter than theirs)."""
    job = job_file(tmp_path, criteo_dataset, nproc=2, workers=1, train__epochs="1", launch__trainer_restarts="0",
                   launch__probe_misses="2")
    result = neorec("launch", str(job))
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "[launch] the trainers finished" in result.stdout and "restarting" not in result.stdout
    assert job_processes(job) == []


@pytest.mark.slow  # a launched job, ~20 s
def test_a_job_s_token_file_reaches_every_service_and_the_launcher_s_own_calls(criteo_dataset, tmp_path):
    """``security.token_file`` is given to the services the launch starts (so they may bind
    beyond loopback) and to the trainer's status service, and the launcher calls with it
    (its stall checks read the trainer's status)."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    job = job_file(tmp_path, criteo_dataset, workers=1, security__token_file=f"'{token}'",
                   launch__host="'0.0.0.0'", train__epochs="30")
    run = tmp_path / "run"
    process = subprocess.Popen([*NEOREC, "launch", str(job)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        _wait_for_steps(run, process, 20)
        services = json.loads((run / "services.json").read_text())
        for address in (services["ingest"][0], services["trainer"][0]):
            assert neorec("status", address, "--json").returncode == 3  # its Status: UNAUTHENTICATED
            assert neorec("status", address, "--json", "--token-file", str(token)).returncode == 0
        process.send_signal(signal.SIGTERM)
        out = process.communicate(timeout=60)[0]
        assert process.returncode == 143, out[-3000:]
        assert "UNAUTHENTICATED" not in out, out[-3000:]
    finally:
        if process.poll() is None:
            process.kill()


def _wait_for_steps(run: Path, process: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + 180
    while True:
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
        if any(json.loads(line)["step"] >= steps for line in lines):
            return
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.slow
def test_ctrl_c_stops_the_whole_job_within_seconds(criteo_dataset, tmp_path):
    job = job_file(tmp_path, criteo_dataset, train__epochs="200")
    process = subprocess.Popen([*NEOREC, "launch", str(job)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        _wait_for_steps(tmp_path / "run", process, 10)
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
        assert time.monotonic() - started < 10
        assert job_processes(job) == []
        assert_ports_free(tmp_path / "run")
    finally:
        if process.poll() is None:
            process.kill()


def _read_until(process: subprocess.Popen, text: str, timeout: float) -> tuple[float, list[str]]:
    """Read the launcher's output until a line holds ``text``; when it came, and the lines."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if text in line:
            return time.monotonic(), lines
        assert line, "".join(lines[-50:])
    raise AssertionError(f"no line with {text!r} within {timeout} s")


@pytest.mark.slow
def test_failed_reader_services_are_noticed_fast_and_restarted_alone_and_the_run_is_unchanged(criteo_dataset,
                                                                                             tmp_path):
    job = job_file(tmp_path, criteo_dataset, train__epochs="6")
    process = subprocess.Popen([*NEOREC, "launch", str(job)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    run = tmp_path / "run"
    try:
        _wait_for_steps(run, process, 20)
        services = json.loads((run / "services.json").read_text())
        killed, hung = (_pid_listening_on(int(a.rsplit(":", 1)[1])) for a in services["ingest"])
        assert killed is not None and hung is not None
        os.kill(killed, signal.SIGKILL)
        at = time.monotonic()
        noticed, _ = _read_until(process, "ingest-0 exited with status -9; restarting it", 30)
        assert noticed - at < 1.0  # the exit is seen at the next 0.25 s tick (plus the output's way here)
        os.kill(hung, signal.SIGSTOP)
        at = time.monotonic()
        noticed, _ = _read_until(process, "ingest-1 missed 3 health probes", 30)
        assert noticed - at < 6.0  # probes every second, three misses
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    plain = neorec("train", str(job), "--set", f"run.dir='{tmp_path / 'plain'}'")
    assert plain.returncode == 0
    assert records(run) == records(tmp_path / "plain")


@pytest.mark.slow
def test_a_killed_store_service_is_restarted_and_the_trainers_resume_unchanged(criteo_dataset, tmp_path):
    job = job_file(tmp_path, criteo_dataset, workers=0, train__epochs="4", launch__store_service="true",
                   embedding_store__tables="{ t_C3 = 0.01, t_C4 = 0.02 }")
    process = subprocess.Popen([*NEOREC, "launch", str(job)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    run = tmp_path / "run"
    try:
        _wait_for_steps(run, process, 25)
        store = json.loads((run / "services.json").read_text())["store"][0]
        os.kill(_pid_listening_on(int(store.rsplit(":", 1)[1])), signal.SIGKILL)
        _read_until(process, "store-0 exited with status -9; restarting it", 30)
        _read_until(process, "restarting the trainers (--resume", 60)
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    plain = neorec("train", str(job), "--set", f"run.dir='{tmp_path / 'plain'}'")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert records(run) == records(tmp_path / "plain")
    assert job_processes(job) == []


def _pid_listening_on(port: int) -> int | None:
    """The process holding a listening socket on ``port`` (from /proc/net/tcp and fds), if
    any (a service being restarted has none)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


def test_kubernetes_manifests_have_probes_and_an_indexed_trainer_job(criteo_dataset, tmp_path):
    job = job_file(tmp_path, criteo_dataset, nproc=2, workers=3)
    config = load_config(job)
    objects = manifests(config, str(job), "registry/neorec:1", ["train.epochs=7"])
    reader, reader_service = objects["ingest.yaml"]
    assert reader["kind"] == "StatefulSet" and reader["spec"]["replicas"] == 3
    container = reader["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": "neorec.ingest.Reader"}
    assert container["livenessProbe"]["grpc"]["service"] == "neorec.ingest.Reader"
    assert "--token-file" in container["command"] and container["image"] == "registry/neorec:1"
    assert reader_service["spec"]["clusterIP"] == "None"
    job_config, trainer, _ = objects["trainer.yaml"]
    assert job_config["kind"] == "ConfigMap" and job_config["data"]["job.toml"] == job.read_text()
    assert trainer["kind"] == "Job" and trainer["spec"]["completionMode"] == "Indexed"
    pod = trainer["spec"]["template"]["spec"]
    assert {"name": "job", "configMap": {"name": "neorec-job"}} in pod["volumes"]
    script = pod["containers"][0]["command"][-1]
    assert "torchrun" in script and "--nproc-per-node=2" in script and "--rdzv-backend=c10d" in script
    assert "neorec-ingest-2.neorec-ingest:50051" in script and "--resume" in script
    words = shlex.split(script.split("exec ", 1)[1])  # what the pod's shell runs: the config it mounts, the settings
    settings = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    assert words[words.index("train") + 1] == "/etc/neorec-job/job.toml"
    assert settings[0] == "train.epochs=7" and f'run.dir="{tmp_path / "run"}"' in settings
    odd = load_config(job, ["run.dir='/tmp/a b$(id)'"])  # a path the shell must not split or expand
    odd_script = manifests(odd, str(job), "x")["trainer.yaml"][1]["spec"]["template"]["spec"]["containers"][0]
    assert "'/tmp/a b$(id)/checkpoint/LATEST'" in odd_script["command"][-1]
    for flags, said in ((["k8s", ""], "--emit k8s DIR: name the directory"), (["k8s", "d", "--image", ""], "--image")):
        refused = neorec_in_process("launch", str(job), "--emit", *flags)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    result = neorec_in_process("launch", str(tmp_path / "job.toml"), "--emit", "k8s", str(tmp_path / "k8s"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "k8s" / "ingest.yaml").read_text()
    assert "kind: \"StatefulSet\"" in text and "---" in text
    (tmp_path / "k8s" / "trainer.yaml").write_text("# edited by hand")
    again = ("launch", str(tmp_path / "job.toml"), "--emit", "k8s", str(tmp_path / "k8s"))
    result = neorec_in_process(*again)
    assert result.returncode == 2 and "already holds ingest.yaml, trainer.yaml" in result.stderr, result.stderr
    assert (tmp_path / "k8s" / "trainer.yaml").read_text() == "# edited by hand"
    assert neorec_in_process(*again, "--overwrite").returncode == 0
    assert "kind: \"Job\"" in (tmp_path / "k8s" / "trainer.yaml").read_text()


def test_a_trainer_pod_resumes_restarts_its_own_run_and_refuses_anothers(criteo_dataset, tmp_path):
    """The trainer pod's command run by a shell (torchrun a stand-in that records its
    arguments): resume once a checkpoint exists; a restart of this Job's pod before its
    first checkpoint starts its run again (it was refused as a run without a checkpoint);
    a run directory holding another run is left to the trainer to refuse."""
    job = job_file(tmp_path, criteo_dataset)
    pod = manifests(load_config(job), str(job), "x")["trainer.yaml"][1]["spec"]["template"]["spec"]
    script = pod["containers"][0]["command"][-1]
    assert pod["containers"][0]["env"][0]["name"] == "NEOREC_JOB_UID"
    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\n")
    (bin_dir / "torchrun").chmod(0o755)

    def flags(uid: str) -> str:
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NEOREC_JOB_UID": uid}
        subprocess.run(["sh", "-c", script], env=env, check=True, timeout=30)
        words = (tmp_path / "args").read_text().split()
        return " ".join(words[words.index("--ingest") + 2:])  # what the script adds after the job's own

    assert flags("") == "" and not run.exists()  # no Job UID (a cluster before 1.27): nothing is marked
    assert flags("job-a") == "" and (run / ".neorec-k8s-job").read_text() == "job-a\n"  # found empty: this Job's
    (run / "config.json").write_text("{}")  # killed before its first checkpoint
    assert flags("job-a") == "--overwrite"
    assert flags("job-b") == "" and flags("") == ""  # another Job's run: refused by the trainer, the marker kept
    assert (run / ".neorec-k8s-job").read_text() == "job-a\n"
    (run / ".neorec-k8s-job").unlink()
    assert flags("job-a") == ""  # a run nobody marked: never overwritten
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "LATEST").write_text("step-1")
    assert flags("job-b") == f"--resume {run}"


def test_a_launch_the_run_directory_refuses_starts_nothing(criteo_dataset, tmp_path):
    """``--resume`` of no run, or a run directory holding a run without ``--overwrite``
    or ``--resume``, is refused before any service starts (exit 2, nothing written). Run in
    this process where the refusal comes before the launcher starts anything."""
    job = job_file(tmp_path, criteo_dataset)
    run = tmp_path / "run"
    result = neorec_in_process("launch", str(job), "--resume")
    assert result.returncode == 2 and "holds no run to resume" in result.stderr, result.stderr
    assert not run.exists()
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    result = neorec_in_process("launch", str(job))
    assert result.returncode == 2 and "already holds a run" in result.stderr, result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    held = lock(run)  # a job's trainer at work in it: a second launch must not touch its services.json
    try:
        result = neorec_in_process("launch", str(job), "--overwrite")
        assert result.returncode == 2 and f"is in use by process {os.getpid()}" in result.stderr, result.stderr
    finally:
        held.release()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "metrics.jsonl"]
    for setting, said in ((f"data.path='{tmp_path / 'none'}'", f"{tmp_path / 'none'}/dataset.json not found"),
                          ("launch.host='name.invalid'", "launch.host: cannot listen on 'name.invalid'")):
        result = neorec_in_process("launch", str(job), "--overwrite", "--set", setting)
        assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert sorted(p.name for p in run.iterdir()) == [".lock", "metrics.jsonl"]
    launcher = lock(run / "logs", what="job log directory", owners="a neorec launch")  # another launch's, starting
    try:
        result = neorec("launch", str(job), "--overwrite", timeout=120)  # a process: it would start a job if let
    finally:
        launcher.release()
    assert result.returncode == 2 and "[ingest-0]" not in result.stdout, result.stdout  # no service started
    assert f"job log directory {run / 'logs'} is in use by process {os.getpid()} (a neorec launch)" in result.stderr
    assert sorted(p.name for p in run.iterdir()) == [".lock", "logs", "metrics.jsonl"]  # no services.json


@pytest.mark.parametrize("code, status, ended", [(0, 1, "exited with status 0"), (-9, 1, "was killed by SIGKILL"),
                                                  (-15, 1, "was killed by SIGTERM"), (1, 1, "exited with status 1"),
                                                  (2, 2, "exited with status 2")])
def test_a_service_ending_while_it_starts_fails_the_job_with_1_or_2_not_its_own_status(code, status, ended):
    """A service stopped by SIGTERM while it starts exits 0, one killed has no status: the
    job failed all the same (the launcher once exited with the service's status: 0, 247)."""
    failed = start_failure("ingest-0", code, ["a", "b", "c", "d"])
    assert failed.status == status
    assert str(failed) == f"ingest-0 {ended} while starting: b / c / d"
    logged = ["2026-11-29 22:31:28,492 neorec INFO serving", "neorec: error: no dataset at /x",
              "2026-11-29 … INFO bye"]
    assert str(start_failure("ingest-0", code, logged)) == f"ingest-0 {ended} while starting: neorec: error: no " \
                                                            "dataset at /x"  # its error, not the log lines around it


@pytest.mark.slow  # a job's reader service started, ~10 s
def test_a_config_the_trainer_refuses_and_a_stop_while_services_start_exit_as_a_command_does(criteo_dataset,
                                                                                             tmp_path):
    job = job_file(tmp_path, criteo_dataset, workers=1)
    refused = neorec("launch", str(job), "--set", "data.train_split='nope'", timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "neorec: error: job failed: the trainer refused the job" in refused.stderr
    assert (tmp_path / "run" / "logs" / "trainer.log").read_text()
    launch = subprocess.Popen([*NEOREC, "launch", str(job), "--overwrite"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    for line in launch.stdout:
        if line.startswith("[ingest-0]"):  # its service is starting
            break
    launch.send_signal(signal.SIGTERM)
    out = launch.communicate(timeout=60)[0]
    assert launch.returncode == 143 and "stopped (SIGTERM) while the services started" in out, out
    assert not (tmp_path / "run" / "logs" / "trainer.log").exists()  # the replaced run's log went with it


@pytest.mark.slow
def test_chaos_kills_and_stops_change_nothing(criteo_dataset, tmp_path):
    """Two reader services, two trainer ranks, fp32 checkpoints; twelve random SIGKILLs and
    SIGSTOPs of random roles while the job runs. It finishes with the weights and metrics of
    a job left alone, and leaves no process or port behind."""
    import random

    from tests.orchestration.test_sharded_cli import _rank_processes

    (tmp_path / "calm").mkdir()
    calm = job_file(tmp_path / "calm", criteo_dataset, nproc=2, train__epochs="30")
    result = neorec("launch", str(calm))
    assert result.returncode == 0, result.stdout[-3000:]
    (tmp_path / "chaos").mkdir()
    job = job_file(tmp_path / "chaos", criteo_dataset, nproc=2, train__epochs="30", launch__restarts="20",
                   launch__trainer_restarts="20", launch__max_backoff_s="1")
    process = subprocess.Popen([*NEOREC, "launch", str(job)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    run = tmp_path / "chaos" / "run"
    rng = random.Random(7)
    faults = []
    try:
        _wait_for_steps(run, process, 5)
        while len(faults) < 12 and process.poll() is None:
            time.sleep(rng.uniform(1.0, 3.0))
            services = json.loads((run / "services.json").read_text())
            targets = {f"ingest-{i}": _pid_listening_on(int(a.rsplit(":", 1)[1]))
                       for i, a in enumerate(services["ingest"])}
            targets = {name: pid for name, pid in targets.items() if pid is not None}
            targets.update({f"rank-{r}": pid for r, pid in _rank_processes(process.pid).items()})
            if not targets:
                continue
            name = rng.choice(sorted(targets))
            sig = rng.choice([signal.SIGKILL, signal.SIGSTOP])
            try:
                os.kill(targets[name], sig)
            except ProcessLookupError:
                continue
            faults.append((name, sig.name))
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert len(faults) >= 10, faults
    assert process.returncode == 0, output[-4000:]
    assert records(run) == records(tmp_path / "calm" / "run")
    a, b = final_state(run), final_state(tmp_path / "calm" / "run")
    assert all(a[k].equal(b[k]) for k in a)
    assert job_processes(job) == []
    assert_ports_free(run)
