"""The training configuration: typed sections, built from a plain dict with errors that
name the bad key (``train.batch_size: expected an integer, got 'x'``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from neorec.common.addresses import check_address
from neorec.common.errors import ConfigError
from neorec.ingest.service_limits import MAX_BATCH_SIZE
from neorec.ingest.client import COMPRESSIONS
from neorec.ingest.decoder import DENSE_TRANSFORMS, ID_MAPPINGS
from neorec.ingest.plan import REMAINDER_POLICIES, SHUFFLE_MODES
from neorec.ingest.renamed_keys import read_renamed
from neorec.ingest.sections import build_section, to_dict
from neorec.trainer.embedding.bounds import BOUNDS_CHECK_MODES
from neorec.trainer.embedding.config import POOLINGS, SPARSE_OPTIMIZERS, WEIGHT_DTYPES
from neorec.trainer.embedding.dynamic.config import DynamicTableConfig
from neorec.trainer.model import MLP_INITS
from neorec.trainer.planner.enumerate import Constraint
from neorec.trainer.planner.inputs import parse_bytes
from neorec.trainer.sharding.comm_precision import CommPrecision
from neorec.trainer.sharding.plan import PlanError

DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "numba", "torch")
RENAMED_KEYS = {"train.prefetch": "train.background_batches"}
"""Old key → its new name: configs (and checkpoints' saved configs) that use the old name
still load, with a warning (see docs/configuration.md)."""


@dataclass
class DataConfig:
    path: str = "data/criteo-synth"
    """The dataset directory (the one holding ``dataset.json``)."""
    train_split: str = "train"
    """The split trained on (a split named in ``dataset.json``)."""
    eval_split: str = "eval"
    """The split evaluated on: after every epoch, every ``train.eval_every`` steps and at the end."""
    dense_transform: str = "log1p"
    """``log1p``: negative values clipped to 0, then ``log(1 + x)`` (DLRM's transform of
    Criteo's counts); ``identity``: as stored (data an importer already transformed)."""
    id_mapping: str = "modulo"
    """``modulo``: id ``i`` looks up row ``i % rows`` of its table; ``strict``: an id beyond
    the table is an error naming file, column and row. Negative ids are always an error."""
    remainder: str = "drop"
    """The rows of an epoch that do not fill a step on every rank: dropped (``drop``) or
    trained in a padded batch (``pad``); either way counted."""
    shuffle: str = "rows"
    """Training order each epoch: ``rows`` (rows mixed within windows of row groups, from
    the seed and epoch), ``row_groups`` (row groups shuffled, rows in file order) or
    ``none`` (file order). Evaluation always reads in file order."""
    shuffle_window: int = 0
    """Row groups per row-shuffling window; 0: enough for ~262k rows."""
    ingest: list[str] = field(default_factory=list)
    """Reader service addresses (host:port); empty: read in process."""
    ingest_compression: str = "none"
    """Batches from the reader services as one zstd frame (``zstd``) or raw (``none``)."""
    ingest_stall_timeout_s: float = 120.0
    """Give up when no reader service delivers anything for this long."""
    ingest_progress_timeout_s: float = 5.0
    """A reader service stream that owes batches and delivers none for this long is
    cancelled and its batches are requested from the other services."""
    follow: bool = False
    """Follow the dataset's time partitions (``partitions/NAME/`` + ``_SUCCESS``) as they
    land: evaluate on each, then train on it (see ``docs/continuous.md``)."""
    poll_interval_s: float = 5.0
    """Following: how often to look for the next partition's marker."""
    idle_exit_s: float = 0.0
    """Following: stop after this many seconds without a new partition (0: never)."""

    def validate(self) -> None:
        for address in self.ingest:
            try:
                check_address(address, "reader service address")
            except ValueError as err:
                raise ConfigError(f"data.ingest: {err}") from None
        _one_of("data.ingest_compression", self.ingest_compression, tuple(COMPRESSIONS))
        _positive("data.ingest_stall_timeout_s", self.ingest_stall_timeout_s)
        _positive("data.ingest_progress_timeout_s", self.ingest_progress_timeout_s)
        _positive("data.poll_interval_s", self.poll_interval_s)
        if self.idle_exit_s < 0:
            raise ConfigError(f"data.idle_exit_s: must be >= 0, got {self.idle_exit_s}")
        for key in ("path", "train_split", "eval_split"):
            if not getattr(self, key):
                raise ConfigError(f"data.{key}: must not be empty")
        _one_of("data.dense_transform", self.dense_transform, DENSE_TRANSFORMS)
        _one_of("data.id_mapping", self.id_mapping, ID_MAPPINGS)
        _one_of("data.remainder", self.remainder, REMAINDER_POLICIES)
        _one_of("data.shuffle", self.shuffle, SHUFFLE_MODES)
        if self.shuffle_window < 0:
            raise ConfigError(f"data.shuffle_window: must be >= 0, got {self.shuffle_window}")


@dataclass
class ModelConfig:
    embedding_dim: int = 16
    """Columns of every embedding table (and the bottom MLP's output)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32, 16])
    """Output size of every bottom MLP layer; the last is ``embedding_dim`` (as TorchRec's
    ``DenseArch`` layer sizes)."""
    top_mlp: list[int] = field(default_factory=lambda: [128, 64, 1])
    """Output size of every top MLP layer; the last is 1 (as TorchRec's ``OverArch``)."""
    init: str = "uniform"
    """MLP initialisation: ``uniform`` (PyTorch's ``nn.Linear`` default, as TorchRec) or
    ``normal`` (the DLRM reference); deterministic from the seed either way."""
    max_table_rows: int = 200_000
    """A table has ``min(cardinality, max_table_rows)`` rows (with ``data.id_mapping =
    'modulo'``, larger ids share rows)."""
    pooling: str = "sum"
    """How a bag's rows are pooled: summed or averaged."""
    weight_dtype: str = "fp32"
    """Embedding weight storage: fp32, fp16 or bf16 (compute and optimizer state stay fp32)."""
    stochastic_rounding: bool = True
    """Round fp16/bf16 weight updates stochastically (else to nearest even)."""
    dynamic: dict[str, DynamicTableConfig] = field(default_factory=dict)
    """Dynamic tables (``[model.dynamic.t_C1] capacity = 1000000``, keys ``capacity``,
    ``min_count``, ``ttl``, ``ttl_unit``, ``sketch_width``, ``sketch_depth``,
    ``sketch_half_life``, ``shards``): raw 64-bit ids mapped to ``capacity`` rows (see
    docs/dynamic-tables.md)."""

    def validate(self) -> None:
        _positive("model.embedding_dim", self.embedding_dim)
        for table, dynamic in self.dynamic.items():
            try:
                dynamic.validate()
            except ValueError as err:
                raise ConfigError(f"model.dynamic.{table}.{err}") from None
        _positive("model.max_table_rows", self.max_table_rows)
        for name, sizes in (("model.bottom_mlp", self.bottom_mlp), ("model.top_mlp", self.top_mlp)):
            if not sizes or any(s <= 0 for s in sizes):
                raise ConfigError(f"{name}: layer sizes must be positive (at least one layer), got {sizes}")
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ConfigError(f"model.bottom_mlp: the sizes are the whole stack and must end with "
                              f"model.embedding_dim ({self.embedding_dim}), got {self.bottom_mlp} "
                              f"(e.g. {[*self.bottom_mlp, self.embedding_dim]})")
        if self.top_mlp[-1] != 1:
            raise ConfigError(f"model.top_mlp: the sizes are the whole stack and must end with 1 (the click "
                              f"logit), got {self.top_mlp} (e.g. {[*self.top_mlp, 1]})")
        _one_of("model.init", self.init, MLP_INITS)
        _one_of("model.pooling", self.pooling, POOLINGS)
        _one_of("model.weight_dtype", self.weight_dtype, tuple(WEIGHT_DTYPES))


@dataclass
class OptimizerConfig:
    sparse: str = "rowwise_adagrad"
    """The embeddings' optimizer, fused into their backward."""
    sparse_lr: float = 0.05
    """The embeddings' learning rate."""
    sparse_eps: float = 1e-8
    """Adagrad's and Adam's epsilon for the embeddings."""
    sparse_weight_decay: float = 0.0
    """Adds ``weight_decay * w`` to the gradient of every updated embedding row."""
    sparse_adagrad_decay: float = 1.0
    """In (0, 1]: ``adagrad``/``rowwise_adagrad`` multiply a row's sum of squared gradients
    by it at each update of the row, so its step size stays bounded away from zero and a
    long run keeps adapting (continuous training); 1 is plain Adagrad."""
    dense: str = "adam"
    """The MLPs' optimizer (``torch.optim``)."""
    dense_lr: float = 1e-3
    """The MLPs' learning rate."""

    def validate(self) -> None:
        _one_of("optimizer.sparse", self.sparse, SPARSE_OPTIMIZERS)
        _one_of("optimizer.dense", self.dense, DENSE_OPTIMIZERS)
        _positive("optimizer.sparse_lr", self.sparse_lr)
        _positive("optimizer.dense_lr", self.dense_lr)
        _positive("optimizer.sparse_eps", self.sparse_eps)
        if self.sparse_weight_decay < 0:
            raise ConfigError(f"optimizer.sparse_weight_decay: must be >= 0, got {self.sparse_weight_decay}")
        if not 0 < self.sparse_adagrad_decay <= 1:
            raise ConfigError(f"optimizer.sparse_adagrad_decay: must lie in (0, 1], got {self.sparse_adagrad_decay}")


@dataclass
class TrainLoopConfig:
    batch_size: int = 512
    """Samples per rank per step (the global batch is ``batch_size * world_size``)."""
    eval_batch_size: int = 4096
    """Samples per rank per evaluation batch."""
    epochs: int = 1
    """Passes over the train split."""
    max_steps: int = 0
    """Stop after this many steps in all (0: when the epochs end)."""
    seed: int = 0
    """Seeds the initial weights, the epochs' order and the rounding noise: the same seed
    and config give the same run, bit for bit."""
    log_every: int = 50
    """Steps between the train lines of ``metrics.jsonl``."""
    eval_every: int = 0
    """Steps between evaluations (0: after every epoch only)."""
    threads: int = 0
    """Threads of torch, the kernels and decoding (0: the CPUs this process may use, shared by
    its host's ranks, fewer while other processes take some: docs/shared-hosts.md)."""
    pin_cores: bool = True
    """When several ranks share a host, run each rank's threads on its own share of the
    host's cores (see :mod:`neorec.trainer.run.affinity`)."""
    batch_scheduling: bool = True
    """When several ranks share a host, run each rank's threads under Linux's ``SCHED_BATCH``
    policy, so that they do not preempt each other when they wake (see
    :mod:`neorec.trainer.run.affinity`)."""
    background_batches: int = 16
    """Batches a background thread keeps ready ahead of training (enough to cover decoding
    the next row group); 0: read in the training thread."""
    device: str = "auto"
    """Where the model, batches and collectives live: ``cpu``, ``cuda`` (this rank's GPU) or
    ``auto`` (CUDA when present)."""
    kernels: str = "auto"
    """Embedding kernels: ``numba`` (CPU), ``torch`` (torch ops, any device: the code a GPU
    runs) or ``auto`` (Numba on CPU, torch ops on CUDA)."""
    bounds_check: str = "fatal"
    """``fatal``: a batch with an id outside its table is refused, naming it, before any
    weight, optimizer state or cache changes; ``none``: trust the ids (see
    docs/guarantees.md)."""
    collective_timeout_s: float = 300.0
    """A collective that waits longer than this for another rank fails, naming the ranks
    that went silent (stopped or hung), instead of hanging the job."""
    tensorboard: bool = False
    """Also write TensorBoard event files (``RUN_DIR/tensorboard``; needs the
    ``tensorboard`` package: ``pip install 'neorec[tensorboard]'``)."""

    def validate(self) -> None:
        for key in ("batch_size", "eval_batch_size", "epochs", "log_every", "collective_timeout_s"):
            _positive(f"train.{key}", getattr(self, key))
        _one_of("train.device", self.device, DEVICES)
        _one_of("train.kernels", self.kernels, KERNELS)
        _one_of("train.bounds_check", self.bounds_check, BOUNDS_CHECK_MODES)
        if self.device == "cuda" and self.kernels == "numba":
            raise ConfigError("train.kernels: numba kernels run on the CPU; with train.device = 'cuda' use 'torch' "
                              "or 'auto'")
        for key in ("max_steps", "eval_every", "threads", "background_batches"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}: must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.seed < 2**63:  # it seeds torch and numpy and enters the 64-bit hashes
            raise ConfigError(f"train.seed: must lie in [0, 2**63), got {self.seed}")


@dataclass
class ShardingConfig:
    """The topology the planner plans for (world size comes from the launch) and per-table
    overrides (``tables.C1 = "row_wise"``, ``"table_wise:3"``, ``"column_wise:2"``,
    ``"table_row_wise:0"``, ``"data_parallel"``)."""

    ranks_per_node: int = 0
    """0: all ranks on one node."""
    group_size: int = 0
    """Ranks of a table_row_wise group; 0: a node."""
    memory_per_rank: str = "16GiB"
    """What a rank may hold of embedding rows and their optimizer state (``16GiB``, ``500MB``)."""
    intra_node_gbps: float = 10.0
    """Bandwidth between the ranks of one node in GB/s (the planner's all-to-all estimates)."""
    inter_node_gbps: float = 1.25
    """Bandwidth between nodes in GB/s."""
    lookup_gbps: float = 2.0
    """GB of embedding rows a rank reads or writes per second."""
    tables: dict[str, str] = field(default_factory=dict)
    """Per-table overrides of the planner's choice (see the section's docstring)."""
    comm_precision: dict[str, str] = field(default_factory=dict)
    """Wire type of the pooled embeddings' all-to-all (``forward``) and of the gradients
    (``backward``: theirs and the MLPs' sums): ``fp32`` (default), ``fp16`` or ``bf16``."""

    def precision(self) -> CommPrecision:
        return CommPrecision(**self.comm_precision)

    def validate(self) -> None:
        try:
            self.precision()
        except (TypeError, ValueError) as err:
            raise ConfigError(f"sharding.comm_precision: {err} (keys: forward, backward)") from None
        for key in ("ranks_per_node", "group_size"):
            if getattr(self, key) < 0:
                raise ConfigError(f"sharding.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("intra_node_gbps", "inter_node_gbps", "lookup_gbps"):
            _positive(f"sharding.{key}", getattr(self, key))
        try:
            memory = parse_bytes(self.memory_per_rank)
        except ValueError as err:
            raise ConfigError(f"sharding.memory_per_rank: {err}") from None
        if memory <= 0:
            raise ConfigError(f"sharding.memory_per_rank: must be more than 0 bytes, got {self.memory_per_rank!r}")
        for table, text in self.tables.items():
            try:
                Constraint.parse(table, text)
            except PlanError as err:
                raise ConfigError(f"sharding.tables.{table}: {err}") from None


STORE_POLICIES = ("lru", "lfu")
DEFAULT_CACHE_FRACTION = 0.25


@dataclass
class EmbeddingStoreConfig:
    """Tables larger than memory: rows on a tier on local disk (segment files), a
    set-associative cache of them in the trainer (see :mod:`neorec.trainer.embedding.store_backed`)."""

    dir: str = ""
    """Where the tier's files go (local disk); empty: ``RUN_DIR/store``. A fresh run empties
    it; a resumed one replaces it by its checkpoint's."""
    tables: dict[str, float] = field(default_factory=dict)
    """Tables the config puts on the store, each with its cache's share of its rows
    (``tables.t_C1 = 0.05``)."""
    cache_fraction: float = DEFAULT_CACHE_FRACTION
    """The cache's share of a table the planner puts on the store because memory
    (``sharding.memory_per_rank``) cannot hold it; 0: the planner puts none there."""
    ways: int = 32
    """Rows per cache set."""
    policy: str = "lru"
    """Which row of a full set leaves: least recently (``lru``) or least frequently
    (``lfu``) used."""
    scratch_rows: int = 0
    """Rows beyond the cache for a batch's rows whose set is full of that batch's rows;
    0: twice the batch's ids of the table, at most its rows."""
    direct_io: bool = False
    """Read the tier with O_DIRECT (every read a disk read, not the page cache's)."""
    service: str = ""
    """``HOST:PORT`` of a store service (``neorec store serve``) that holds the tier;
    empty: the trainer holds it."""

    def validate(self) -> None:
        for table, fraction in self.tables.items():
            if not 0 < fraction <= 1:
                raise ConfigError(f"embedding_store.tables.{table}: a cache fraction in (0, 1], got {fraction}")
        if not 0 <= self.cache_fraction <= 1:
            raise ConfigError(f"embedding_store.cache_fraction: must lie in [0, 1], got {self.cache_fraction}")
        _positive("embedding_store.ways", self.ways)
        _one_of("embedding_store.policy", self.policy, STORE_POLICIES)
        if self.scratch_rows < 0:
            raise ConfigError(f"embedding_store.scratch_rows: must be >= 0, got {self.scratch_rows}")
        if self.service:
            try:
                check_address(self.service, "store service address")
            except ValueError as err:
                raise ConfigError(f"embedding_store.service: {err}") from None


CHECKPOINT_MODES = ("full", "incremental")
CHECKPOINT_BITS = (32, 16, 8, 4, 2)


@dataclass
class CheckpointConfig:
    """When and how training writes checkpoints (``RUN_DIR/checkpoint``)."""

    every_steps: int = 0
    """Write one every this many steps (0: not by steps)."""
    every_minutes: float = 0.0
    """Write one when this many minutes have passed since the last (0: not by time); checked
    at the steps that log metrics, where the ranks already meet."""
    keep: int = 3
    """Keep the newest this many checkpoints (and the ones their chains need)."""
    mode: str = "incremental"
    """``full`` (every row each time) or ``incremental`` (the rows modified since the last
    checkpoint; a new full one when the increments would cost more to restore than it)."""
    bits: int = 32
    """Embedding weights as stored (32), fp16 (16), or quantized per row to 8/4/2 bits.
    Optimizer state and the MLPs are always float32."""
    asynchronous: bool = field(default=True, metadata={"key": "async"})
    """Write in the background: training stalls only for the copy of the rows (``async``)."""
    final: bool = True
    """Write a checkpoint when training ends."""
    fallback: bool = False
    """Resuming: when the newest checkpoint is corrupt, restore the newest whole one (else
    the corruption is an error naming the file)."""
    keep_best: bool = False
    """Checkpoint after every evaluation that beats the best eval AUC so far, and keep that
    checkpoint (``checkpoint/BEST`` names it) whatever ``keep`` says."""
    every_partitions: int = 0
    """Following partitions: write one after every this many partitions trained (0: not
    by partitions)."""

    def validate(self) -> None:
        for key in ("every_steps", "every_minutes", "every_partitions"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key}: must be >= 0, got {getattr(self, key)}")
        _positive("checkpoint.keep", self.keep)
        _one_of("checkpoint.mode", self.mode, CHECKPOINT_MODES)
        if self.bits not in CHECKPOINT_BITS:
            raise ConfigError(f"checkpoint.bits: must be one of {', '.join(map(str, CHECKPOINT_BITS))}; got {self.bits}")


@dataclass
class LaunchConfig:
    """How ``neorec launch`` runs the job on this host (see :mod:`neorec.orchestration.launch`)."""

    ingest_workers: int = 2
    """Reader services to start (0: the trainers read in process)."""
    store_service: bool = False
    """Start an embedding store service (``neorec store serve``, its tiers under
    ``RUN_DIR/store-service``) for the trainers' store tables; else the trainers hold them."""
    worker_threads: int = 2
    """Decode threads of each reader service."""
    nproc: int = 1
    """Trainer ranks (through torchrun when more than one)."""
    host: str = "127.0.0.1"
    """Where the services bind."""
    restarts: int = 5
    """Restarts allowed per reader service before the job fails."""
    trainer_restarts: int = 3
    """Restarts of the trainer group (from the newest checkpoint) before the job fails."""
    startup_grace_s: float = 60.0
    """A process gets this long to come up (answer its health probe) before that counts."""
    probe_interval_s: float = 1.0
    """Seconds between health probes of every service."""
    probe_misses: int = 3
    """A service that misses this many probes in a row (a hung process) is restarted."""
    backoff_s: float = 0.5
    """Wait before the first restart of a process; doubled each time it fails again."""
    max_backoff_s: float = 10.0
    """The longest wait before a restart."""
    trainer_stall_s: float = 120.0
    """A trainer whose step has not advanced for this long (evaluation and checkpoints
    included) is hung: its group is restarted."""

    def validate(self) -> None:
        for key in ("ingest_workers", "restarts", "trainer_restarts"):
            if getattr(self, key) < 0:
                raise ConfigError(f"launch.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("worker_threads", "nproc", "probe_misses"):
            _positive(f"launch.{key}", getattr(self, key))
        for key in ("startup_grace_s", "probe_interval_s", "backoff_s", "max_backoff_s", "trainer_stall_s"):
            _positive(f"launch.{key}", getattr(self, key))
        if not self.host.strip():
            raise ConfigError("launch.host: must name an address of this host (e.g. 127.0.0.1)")


@dataclass
class RunConfig:
    dir: str = "runs/latest"
    """The run directory: config, metrics, summary, checkpoints."""

    def validate(self) -> None:
        if not self.dir.strip():
            raise ConfigError("run.dir: must name a directory")


@dataclass
class SecurityConfig:
    """How the trainer connects to reader and store services exposed beyond loopback."""

    tls_ca: str = ""
    """PEM certificate the services' TLS certificates are verified with; empty: no TLS."""
    token_file: str = ""
    """File holding the services' shared token; empty: ``$NEOREC_TOKEN`` if set."""

    def validate(self) -> None:
        for key in ("tls_ca", "token_file"):
            path = getattr(self, key)
            if path and not Path(path).is_file():
                raise ConfigError(f"security.{key}: {path} is not a file")


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    embedding_store: EmbeddingStoreConfig = field(default_factory=EmbeddingStoreConfig)

    def validate(self) -> None:
        for section in (self.data, self.model, self.optimizer, self.train, self.sharding, self.checkpoint, self.run,
                        self.security, self.launch, self.embedding_store):
            section.validate()
        self.for_world(self.launch.nproc)  # the ranks of one host, at least
        if self.data.ingest:
            for key in ("batch_size", "eval_batch_size"):
                if getattr(self.train, key) > MAX_BATCH_SIZE:
                    raise ConfigError(f"train.{key}: a reader service cuts batches of at most {MAX_BATCH_SIZE:,} rows, "
                                      f"got {getattr(self.train, key):,} (data.ingest reads through services)")
        if not self.data.follow:
            self._check_partition_counts()
        if self.train.device == "cuda" and self.embedding_store.tables:
            raise ConfigError("embedding_store.tables: store-backed tables train on the CPU only; with "
                              "train.device = 'cuda' keep every table in device memory (or train on the CPU)")

    def _check_partition_counts(self) -> None:
        """:class:`ConfigError` for a setting that counts partitions in a run that follows
        none (it would never take effect)."""
        for name, dynamic in self.model.dynamic.items():
            if (dynamic.ttl or dynamic.sketch_half_life) and dynamic.ttl_unit == "partitions":
                effect = "no id would expire" if dynamic.ttl else "no admission count would halve"
                raise ConfigError(f"model.dynamic.{name}.ttl_unit: 'partitions' counts the partitions a following "
                                  f"run trains (data.follow), and this run follows none, so {effect}; "
                                  f"count 'steps', or follow")
        if self.checkpoint.every_partitions:
            raise ConfigError("checkpoint.every_partitions: counts the partitions a following run trains "
                              "(data.follow), and this run follows none; use every_steps or every_minutes")

    def for_world(self, world_size: int) -> "TrainConfig":
        """This config for a run of ``world_size`` ranks: its dynamic tables' ``shards`` 0
        become the world size (:meth:`DynamicTableConfig.for_world`); :class:`ConfigError`
        naming the key when a table's map shards do not split over the ranks."""
        resolved = {}
        for name, dynamic in self.model.dynamic.items():
            try:
                resolved[name] = dynamic.for_world(world_size)
            except ValueError as err:
                raise ConfigError(f"model.dynamic.{name}.{err}") from None
        return replace(self, model=replace(self.model, dynamic=resolved)) if resolved else self

    def to_dict(self) -> dict[str, Any]:
        """The config as TOML would write it (``from_dict`` reads it back)."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "TrainConfig":
        config = build_section(cls, read_renamed(obj, RENAMED_KEYS, ConfigError), "", ConfigError)
        config.validate()
        return config


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: must be one of {', '.join(allowed)}; got {value!r}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be positive, got {value}")
