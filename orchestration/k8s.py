"""``neorec launch JOB.toml --emit k8s DIR``: the job's roles as Kubernetes manifests.

- ``ingest.yaml``: the reader services, a StatefulSet of ``launch.ingest_workers`` pods
  with native gRPC readiness and liveness probes on their health service, behind a
  headless Service (trainers reach each pod by its stable DNS name);
- ``trainer.yaml``: the job's config (a ConfigMap), and the trainers, an indexed Job of one
  pod per node running torchrun with c10d rendezvous on pod 0 (a headless Service names
  it), ``launch.nproc`` ranks per pod.

The dataset and the run directory are expected on a volume every pod mounts at the same
path (``DATA_CLAIM`` / ``RUN_CLAIM``, ReadWriteMany claims the operator creates), and the
services' shared token in the Secret ``neorec-token``: the reader services bind every
interface and so require it. The files are YAML written from plain dictionaries
(:func:`manifests` returns them, for tests and for tools).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Sequence

from neorec.common.durable import write_durably
from neorec.common.errors import PathError
from neorec.trainer.config import TrainConfig
from neorec.trainer.run.run_dir import RUN_FILES

READER_PORT = 50051
RENDEZVOUS_PORT = 29500
DATA_CLAIM = "neorec-data"
RUN_CLAIM = "neorec-runs"
TOKEN_SECRET = "neorec-token"
JOB_CONFIG_MAP = "neorec-job"
JOB_MOUNT = "/etc/neorec-job"
JOB_FILE = "job.toml"
JOB_MARKER = ".neorec-k8s-job"
"""In a run directory a trainer Job found empty: the Job's UID (its pods restarted before
the first checkpoint start its run again with ``--overwrite``)."""


def manifests(config: TrainConfig, config_path: str, image: str,
              overrides: Sequence[str] = ()) -> dict[str, list[dict[str, Any]]]:
    """File name → the Kubernetes objects it holds. The job's config file travels in a
    ConfigMap (the pods do not see the host's files), with the ``--set`` ``overrides`` the
    launch was given and the data and run paths made absolute."""
    launch = config.launch
    data_path = str(Path(config.data.path).resolve())
    run_path = str(Path(config.run.dir).resolve())
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": DATA_CLAIM}},
               {"name": "runs", "persistentVolumeClaim": {"claimName": RUN_CLAIM}},
               {"name": "token", "secret": {"secretName": TOKEN_SECRET}}]
    mounts = [{"name": "data", "mountPath": data_path}, {"name": "runs", "mountPath": str(Path(run_path).parent)},
              {"name": "token", "mountPath": "/etc/neorec", "readOnly": True}]
    job_config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": JOB_CONFIG_MAP},
                  "data": {JOB_FILE: Path(config_path).read_text()}}
    probe = {"grpc": {"port": READER_PORT, "service": "neorec.ingest.Reader"}, "periodSeconds": 1,
             "failureThreshold": launch.probe_misses}
    reader_labels = {"app": "neorec", "role": "ingest"}
    reader = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "neorec-ingest", "labels": reader_labels},
        "spec": {
            "serviceName": "neorec-ingest",
            "replicas": launch.ingest_workers,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": reader_labels},
            "template": {"metadata": {"labels": reader_labels}, "spec": {
                "containers": [{
                    "name": "ingest", "image": image,
                    "command": ["neorec", "ingest", "serve", "--host", "0.0.0.0", "--port", str(READER_PORT),
                                "--data-root", data_path, "--worker-threads", str(launch.worker_threads),
                                "--token-file", "/etc/neorec/token"],
                    "ports": [{"name": "grpc", "containerPort": READER_PORT}],
                    "readinessProbe": probe,
                    "livenessProbe": {**probe, "initialDelaySeconds": int(launch.startup_grace_s)},
                    "volumeMounts": mounts,
                }],
                "volumes": volumes,
            }},
        },
    }
    reader_service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "neorec-ingest"},
        "spec": {"clusterIP": "None", "selector": reader_labels, "ports": [{"name": "grpc", "port": READER_PORT}]},
    }
    nodes = max(1, launch.nproc // max(config.sharding.ranks_per_node or launch.nproc, 1))
    trainer_labels = {"app": "neorec", "role": "trainer"}
    readers = ",".join(f"neorec-ingest-{i}.neorec-ingest:{READER_PORT}" for i in range(launch.ingest_workers))
    settings = [*overrides, f"data.path={json.dumps(data_path)}", f"run.dir={json.dumps(run_path)}",
                "security.token_file='/etc/neorec/token'"]  # after the launch's own: these win
    torchrun = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={launch.nproc // nodes}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=neorec-trainer-0.neorec-trainer:{RENDEZVOUS_PORT}",
                "--module", "neorec.orchestration.cli", "train", f"{JOB_MOUNT}/{JOB_FILE}",
                *[a for setting in settings for a in ("--set", setting)]]
    if readers:
        torchrun += ["--ingest", readers]
    latest, run, marker = (shlex.quote(p) for p in (f"{run_path}/checkpoint/LATEST", run_path,
                                                     f"{run_path}/{JOB_MARKER}"))
    run_files = " ".join(shlex.quote(f"{run_path}/{name}") for name in RUN_FILES)
    # A restarted pod resumes from the run's newest checkpoint; one restarted before the first
    # checkpoint starts this Job's run again. The marker in the run directory names the Job that
    # found it empty (its UID, a label from Kubernetes 1.27): another run there is refused.
    uid = '"$NEOREC_JOB_UID"'
    script = "; ".join([
        f"if [ -e {latest} ]; then set -- --resume {run}",
        f'elif [ -n {uid} ] && [ "$(cat {marker} 2>/dev/null)" = {uid} ]; then set -- --overwrite',
        "else set --",
        f'held=; for f in {run_files}; do [ -e "$f" ] && held=1; done',
        f"if [ -z \"$held\" ] && [ -n {uid} ]; then mkdir -p {run} && echo {uid} > {marker}; fi; fi",
        f'exec {shlex.join(torchrun)} "$@"'])
    trainer = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "neorec-trainer", "labels": trainer_labels},
        "spec": {
            "completions": nodes, "parallelism": nodes, "completionMode": "Indexed",
            "backoffLimit": launch.trainer_restarts,
            "template": {"metadata": {"labels": trainer_labels}, "spec": {
                "subdomain": "neorec-trainer", "restartPolicy": "Never",
                "containers": [{
                    "name": "trainer", "image": image,
                    "command": ["sh", "-c", script],
                    "env": [{"name": "NEOREC_JOB_UID", "valueFrom": {"fieldRef": {
                        "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}}],
                    "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
                    "volumeMounts": [*mounts, {"name": "job", "mountPath": JOB_MOUNT, "readOnly": True}],
                }],
                "volumes": [*volumes, {"name": "job", "configMap": {"name": JOB_CONFIG_MAP}}],
            }},
        },
    }
    trainer_service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "neorec-trainer"},
        "spec": {"clusterIP": "None", "selector": trainer_labels,
                 "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]},
    }
    return {"ingest.yaml": [reader, reader_service], "trainer.yaml": [job_config, trainer, trainer_service]}


def write_manifests(config: TrainConfig, config_path: str, directory: str | Path, image: str,
                    overwrite: bool = False, overrides: Sequence[str] = ()) -> list[Path]:
    """Write :func:`manifests` into ``directory``, each file atomically; returns the files
    written. Manifests already there are replaced only with ``overwrite`` (a
    :class:`PathError` names them otherwise, and nothing is written)."""
    if not str(directory).strip():
        raise PathError("--emit k8s DIR: name the directory to write the manifests into")
    if not image.strip():
        raise PathError("--image: name the container image the pods run")
    directory = Path(directory)
    files = manifests(config, config_path, image, overrides)
    present = [name for name in files if (directory / name).exists()]
    if present and not overwrite:
        raise PathError(f"{directory} already holds {', '.join(present)}: pass --overwrite to replace them, or "
                        f"choose another directory")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in files.items():
        path = directory / name
        write_durably(path, "---\n".join(to_yaml(o) for o in objects).encode())
        written.append(path)
    return written


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of dictionaries, lists and scalars (strings as JSON strings, which
    YAML reads as the same strings)."""
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:\n{to_yaml(item, indent + 1)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return "\n".join(lines) + ("\n" if indent == 0 else "")
    if isinstance(value, list):
        lines = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                body = to_yaml(item, indent + 1).lstrip()
                lines.append(f"{pad}- {body}")
            else:
                lines.append(f"{pad}- {_scalar(item)}")
        return "\n".join(lines)
    return f"{pad}{_scalar(value)}"


def _scalar(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "{}" if isinstance(value, dict) else "[]"
    return json.dumps(value)
