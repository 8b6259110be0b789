"""Synthetic CTR datasets with a planted teacher, so the best possible AUC is known.

Profiles:

* ``criteo``: 13 dense count columns ``I1..I13`` (some missing) and 26 single-id columns
  ``C1..C26`` whose cardinalities are those of Criteo Kaggle (from 3 to ~10M), with
  Zipf-skewed ids and some missing values.
* ``multihot``: 13 dense columns and 8 ``list<int64>`` columns ``M1..M8`` (100k-1M ids,
  variable length with mean ~20).

Labels come from a teacher: each id of each feature has its own 2-dim embedding (hashed
from the seed, so no table is stored; its scale shrinks with the id's rarity, so the
signal lies mostly in ids a student sees often), pooled by mean for multi-hot bags,
concatenated with ``log1p`` of the dense columns and fed to a random linear term plus a
small random MLP (first-order effects dominate, as in real CTR data); the output is
rescaled to a fixed logit spread and ``label ~ Bernoulli(sigmoid(logit))``. The AUC, log
loss and NE of the teacher's true probabilities on the eval split (the oracle) are stored
in ``dataset.json``.

With ``partitions = K`` the rows are written as K time partitions instead of train/eval
splits (:mod:`neorec.ingest.partitions`: ``partitions/NAME/`` with its ``_SUCCESS`` marker
written last, names one hour apart), each with the teacher's metrics on its own rows in
its ``partition.json``. ``drift`` makes the teacher move between partitions: partition
``k``'s id vectors are ``cos(a) E0 + sin(a) E1`` with ``a = k * drift * pi / 2`` and two
independent hashed vector fields ``E0``, ``E1`` (the dense part stays), so a model that
stops learning falls behind while one that keeps training can follow. A drifted partition's
``partition.json`` also holds ``late_oracle``: the metrics on its rows of the teacher of
the partition before (a perfect model one partition late), the best a model trained up to
the previous partition can expect there.

Raw-id mode (``raw_ids``): each id is a 64-bit hash of its feature and Zipf rank (any
int64), the columns are marked ``raw``, for dynamic tables; ``id_space`` draws every
feature's ranks from that many ids instead of the profile's cardinalities (e.g. 10^8, of
which the data holds a few million). The same spec without ``raw_ids`` holds the same rows
with ids in ``[0, id_space)`` (a fixed bijection of the ranks), for hashed or vocabulary
baselines.

Everything is vectorized per row group; the same spec and seed give the same files.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from neorec.common.errors import UserError
from neorec.common.hashing import SALT, combine, splitmix64
from neorec.ingest.metrics import binary_metrics
from neorec.ingest.partitions import MARKER, PARTITION_FILE, partitions_dir
from neorec.ingest.schema import PARQUET_WRITE_OPTIONS, RAW_CARDINALITY, Dataset, DatasetSchema, SparseFeature

CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# Fraction of rows with a missing value, per column (shaped like Criteo's missingness).
CRITEO_DENSE_MISSING = (0.45, 0.0, 0.2, 0.2, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.76, 0.2)
CRITEO_SPARSE_MISSING = (0.0,) * 18 + (0.44, 0.44, 0.0, 0.76, 0.0, 0.0, 0.44, 0.44)
MULTIHOT_CARDINALITIES = (100_000, 200_000, 300_000, 500_000, 500_000, 800_000, 1_000_000, 1_000_000)

PROFILES = ("criteo", "multihot")
TEACHER_DIM = 2
TEACHER_HIDDEN = 32
LOGIT_SCALE = 1.9
LOGIT_BIAS = -1.55
RARITY_RANK = 20.0
LINEAR_WEIGHT = 2.0  # scale of the first-order term against the MLP
PILOT_ROWS = 16384
FIRST_PARTITION = datetime(2026, 1, 1)
"""The time the first synthetic partition is named after (partitions are an hour apart)."""
DRIFT_SALT = 0x5EED_D21F

ProgressFn = Callable[[int], None]


class SynthSpecError(UserError, ValueError):
    """A :class:`SynthSpec` that cannot be generated (a ``neorec data synth`` argument)."""

    lasting = True


@dataclass(frozen=True)
class SynthSpec:
    """What to generate. ``rows`` counts train and eval rows together."""

    profile: str = "criteo"
    rows: int = 250_000
    eval_fraction: float = 0.2
    seed: int = 0
    zipf_alpha: float = 1.2
    row_group_rows: int = 65_536
    file_rows: int = 1_048_576
    mean_pooling: float = 20.0
    partitions: int = 0
    """Write the rows as this many time partitions instead of train/eval splits."""
    drift: float = 0.0
    """Quarter turns the teacher's id vectors rotate per partition (see the module doc)."""
    raw_ids: bool = False
    """Ids are 64-bit hashes of (feature, rank): raw ids for dynamic tables."""
    id_space: int = 0
    """Ids each feature draws from (0: the profile's cardinalities)."""

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise SynthSpecError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        if self.rows < 2:
            raise SynthSpecError(f"rows must be at least 2, got {self.rows}")
        if not 0 < self.eval_fraction < 1:
            raise SynthSpecError(f"eval_fraction must lie in (0, 1), got {self.eval_fraction}")
        if self.seed < 0:
            raise SynthSpecError(f"seed must be >= 0, got {self.seed}")
        if not self.zipf_alpha > 1.0:
            raise SynthSpecError(f"zipf_alpha must be > 1, got {self.zipf_alpha}")
        if not (self.partitions >= 0 and 0 <= self.drift < math.inf):
            raise SynthSpecError(f"partitions and drift must be >= 0, got {self.partitions} and {self.drift}")
        if self.drift and not self.partitions:
            raise SynthSpecError(f"drift {self.drift:g} turns the teacher between partitions: give partitions too")
        if self.partitions and self.rows < self.partitions:
            raise SynthSpecError(f"{self.rows} rows cannot fill {self.partitions} partitions")
        if self.id_space < 0 or self.id_space >= 2**62:
            raise SynthSpecError(f"id_space must lie in [0, 2**62), got {self.id_space}")


def profile_schema(profile: str, id_space: int = 0) -> DatasetSchema:
    """The profile's columns; ``id_space``: every feature's cardinality instead of the
    profile's."""
    dense = tuple(f"I{i}" for i in range(1, 14))
    if profile == "criteo":
        sparse = tuple(SparseFeature(f"C{i + 1}", id_space or c) for i, c in enumerate(CRITEO_KAGGLE_CARDINALITIES))
    elif profile == "multihot":
        sparse = tuple(SparseFeature(f"M{i + 1}", id_space or c, multi_hot=True)
                       for i, c in enumerate(MULTIHOT_CARDINALITIES))
    else:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    return DatasetSchema(label="label", dense=dense, sparse=sparse)


def spec_schema(spec: SynthSpec) -> DatasetSchema:
    """The schema of ``spec``'s files (what :func:`_rows` draws from, and the raw marks)."""
    schema = profile_schema(spec.profile, spec.id_space)
    if not spec.raw_ids:
        return schema
    return DatasetSchema(schema.label, schema.dense, tuple(
        SparseFeature(f.name, RAW_CARDINALITY, f.multi_hot, f.table, raw=True) for f in schema.sparse))


def raw_id(ranks: np.ndarray, feature: int) -> np.ndarray:
    """int64 ``[n]``: the raw 64-bit id of each Zipf rank of feature number ``feature``."""
    return splitmix64(ranks.astype(np.uint64) ^ np.uint64(combine(SALT, feature))).view(np.int64)


def generate(spec: SynthSpec, out_dir: str | Path, progress: ProgressFn | None = None) -> Dataset:
    """Write ``spec``'s dataset into ``out_dir`` and return its description."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = profile_schema(spec.profile, spec.id_space)
    if spec.partitions:
        dataset = partitioned_dataset(spec, out)
        teacher = _Teacher(spec, schema)
        for index in range(spec.partitions):
            write_partition(spec, out, index, progress, teacher)
        return dataset
    teacher = _Teacher(spec, schema)
    eval_rows = max(1, int(round(spec.rows * spec.eval_fraction)))
    split_rows = {"train": spec.rows - eval_rows, "eval": eval_rows}
    splits: dict[str, list[str]] = {}
    oracle = None
    for split_id, (split, rows) in enumerate(split_rows.items()):
        labels, probabilities, files = _write_split(spec, schema, teacher, out, split, split_id, rows, progress)
        splits[split] = files
        if split == "eval":
            metrics = binary_metrics(labels, probabilities[0])
            oracle = {f"eval_{k}": v for k, v in _without_calibration(metrics).items()}
            oracle["eval_label_rate"] = float(labels.mean())
    dataset = Dataset(
        root=out,
        schema=spec_schema(spec),
        splits=splits,
        rows=split_rows,
        profile=spec.profile,
        oracle=oracle,
        generator={"kind": "neorec-synth", **asdict(spec)},
    )
    dataset.save()
    return dataset


def partitioned_dataset(spec: SynthSpec, out_dir: str | Path) -> Dataset:
    """Write the ``dataset.json`` of ``spec``'s partitioned dataset (schema, no splits), for
    :func:`write_partition` to add partitions to."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dataset = Dataset(root=out, schema=spec_schema(spec), splits={}, profile=spec.profile,
                      generator={"kind": "neorec-synth", **asdict(spec)})
    dataset.save()
    return dataset


def partition_name(index: int) -> str:
    """The name of synthetic partition ``index`` (hours after :data:`FIRST_PARTITION`)."""
    return (FIRST_PARTITION + timedelta(hours=index)).strftime("%Y-%m-%dT%H")


def partition_rows(spec: SynthSpec, index: int) -> int:
    """The rows of partition ``index``: ``spec.rows`` spread over ``spec.partitions``, the
    first ``spec.rows % spec.partitions`` one row longer (so that they add up to
    ``spec.rows``); a partition past them has the shorter length."""
    count = max(spec.partitions, 1)
    return spec.rows // count + (1 if index < spec.rows % count else 0)


def write_partition(spec: SynthSpec, out_dir: str | Path, index: int, progress: ProgressFn | None = None,
                    teacher: "_Teacher | None" = None) -> str:
    """Write partition ``index`` of ``spec`` (:func:`partition_rows` rows; the teacher
    drifted ``index`` times) under ``out_dir``, marker last; returns its name.
    Partitions past ``spec.partitions`` may be written too (more data landing later)."""
    schema = profile_schema(spec.profile, spec.id_space)
    base = teacher or _Teacher(spec, schema)
    teacher = base.drifted(index * spec.drift * math.pi / 2)
    late = base.drifted((index - 1) * spec.drift * math.pi / 2) if index > 0 and spec.drift > 0 else None
    name = partition_name(index)
    directory = partitions_dir(out_dir) / name
    directory.mkdir(parents=True, exist_ok=True)
    rows = partition_rows(spec, index)
    labels, probabilities, _ = _write_split(spec, schema, teacher, directory, "part", 2 + index, rows, progress,
                                            late)
    metrics = binary_metrics(labels, probabilities[0])
    info = {"rows": rows, "oracle": _without_calibration(metrics), "label_rate": float(labels.mean())}
    if late is not None:
        info["late_oracle"] = _without_calibration(binary_metrics(labels, probabilities[1]))
    (directory / PARTITION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    (directory / MARKER).touch()
    return name


def _without_calibration(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != "calibration"}


def _write_split(
    spec: SynthSpec,
    schema: DatasetSchema,
    teacher: "_Teacher",
    out: Path,
    split: str,
    split_id: int,
    rows: int,
    progress: ProgressFn | None,
    late: "_Teacher | None" = None,
) -> tuple[np.ndarray, list[np.ndarray], list[str]]:
    """Write ``rows`` rows labelled by ``teacher``; returns the labels (float32 ``[rows]``),
    the click probabilities (float64 ``[rows]``) of ``teacher`` and, when given, of the
    ``late`` teacher on the same rows, and the file names."""
    arrow_schema = _arrow_schema(schema)
    labels, files = [], []
    probabilities: list[list[np.ndarray]] = [[] for _ in range(1 if late is None else 2)]
    done = 0
    file_index = 0
    while done < rows:
        name = f"{split}-{file_index:05d}.parquet"
        files.append(name)
        file_end = min(rows, done + spec.file_rows)
        with pq.ParquetWriter(out / name, arrow_schema, **PARQUET_WRITE_OPTIONS) as writer:
            while done < file_end:
                n = min(spec.row_group_rows, file_end - done)
                seed = [spec.seed, split_id, done]
                rng = np.random.default_rng(seed)
                table, raw = _rows(spec, schema, teacher, rng, n, arrow_schema)
                p = teacher.probability(raw)
                y = (rng.random(n) < p).astype(np.float32)
                table = table.set_column(0, arrow_schema.field(0), pa.array(y))
                writer.write_table(table, row_group_size=spec.row_group_rows)
                labels.append(y)
                probabilities[0].append(p)
                if late is not None:  # the same rows (same draws), the other teacher's outputs
                    _, late_raw = _rows(spec, schema, late, np.random.default_rng(seed), n, arrow_schema)
                    probabilities[1].append(late.probability(late_raw))
                done += n
                if progress is not None:
                    progress(n)
        file_index += 1
    return np.concatenate(labels), [np.concatenate(p) for p in probabilities], files


def _arrow_schema(schema: DatasetSchema) -> pa.Schema:
    fields = [pa.field(schema.label, pa.float32(), nullable=False)]
    fields += [pa.field(name, pa.float32()) for name in schema.dense]
    fields += [pa.field(f.name, pa.list_(pa.int64()) if f.multi_hot else pa.int64()) for f in schema.sparse]
    return pa.schema(fields)


def _rows(
    spec: SynthSpec,
    schema: DatasetSchema,
    teacher: "_Teacher",
    rng: np.random.Generator,
    n: int,
    arrow_schema: pa.Schema,
) -> tuple[pa.Table, np.ndarray]:
    """``n`` rows (label column left empty) and the teacher's raw outputs for them."""
    columns: list[pa.Array] = [pa.nulls(n, pa.float32())]
    dense_seen = np.empty((n, len(schema.dense)), dtype=np.float32)
    for j, name in enumerate(schema.dense):
        counts = np.floor(np.expm1(np.maximum(0.0, rng.normal(1.0 + 0.15 * j, 1.2, n)))).astype(np.float32)
        missing = rng.random(n) < (CRITEO_DENSE_MISSING[j] if spec.profile == "criteo" else 0.0)
        columns.append(pa.array(counts, mask=missing))
        dense_seen[:, j] = np.where(missing, 0.0, counts)
    pooled = []
    for f, feature in enumerate(schema.sparse):
        if feature.multi_hot:
            lengths = rng.poisson(spec.mean_pooling, n).astype(np.int32)
            ranks = _zipf_ranks(rng, feature.cardinality, spec.zipf_alpha, int(lengths.sum()))
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            ids = raw_id(ranks, f) if spec.raw_ids else _rank_to_id(ranks, feature.cardinality, f)
            columns.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)))
            pooled.append(teacher.pooled_mean(f, ranks, lengths))
        else:
            ranks = _zipf_ranks(rng, feature.cardinality, spec.zipf_alpha, n)
            missing = rng.random(n) < (CRITEO_SPARSE_MISSING[f] if spec.profile == "criteo" else 0.0)
            ids = raw_id(ranks, f) if spec.raw_ids else _rank_to_id(ranks, feature.cardinality, f)
            columns.append(pa.array(ids, mask=missing))
            emb = teacher.embedding(f, ranks)
            emb[missing] = 0.0
            pooled.append(emb)
    raw = teacher.raw_output(np.log1p(dense_seen), np.concatenate(pooled, axis=1))
    table = pa.Table.from_arrays(columns, schema=arrow_schema)
    return table, raw


def _zipf_ranks(rng: np.random.Generator, cardinality: int, alpha: float, size: int) -> np.ndarray:
    """Ranks in ``[0, cardinality)`` with ``P(rank r) ~ (r + 1)^-alpha`` (continuous inverse CDF)."""
    u = rng.random(size)
    top = float(cardinality) ** (1.0 - alpha)
    ranks = np.floor((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - alpha))).astype(np.int64) - 1
    return np.clip(ranks, 0, cardinality - 1)


_MULTIPLIERS = (2654435761, 2246822519, 3266489917, 668265263, 374761393, 1181783497, 2870177450, 1597334677)


def _rank_to_id(ranks: np.ndarray, cardinality: int, feature: int) -> np.ndarray:
    """A fixed bijection of ``[0, cardinality)`` so that popular ids are not the small ones."""
    multiplier = _MULTIPLIERS[feature % len(_MULTIPLIERS)]
    while np.gcd(multiplier, cardinality) != 1:
        multiplier += 1
    return (ranks * (multiplier % cardinality) + 7919 * feature) % cardinality


class _Teacher:
    """The planted model; see the module docstring."""

    def __init__(self, spec: SynthSpec, schema: DatasetSchema) -> None:
        self.salt = spec.seed * 1_000_003 + 17
        rng = np.random.default_rng([spec.seed, 7919])
        width = len(schema.dense) + TEACHER_DIM * len(schema.sparse)
        self.w1 = rng.normal(0.0, 1.0 / np.sqrt(width), (width, TEACHER_HIDDEN))
        self.b1 = rng.normal(0.0, 0.5, TEACHER_HIDDEN)
        self.w2 = rng.normal(0.0, 1.0 / np.sqrt(TEACHER_HIDDEN), TEACHER_HIDDEN)
        self.w_linear = rng.normal(0.0, LINEAR_WEIGHT / np.sqrt(width), width)
        self.angle = 0.0
        """Radians the id vectors turned from the first field towards the second."""
        pilot_rng = np.random.default_rng([spec.seed, 104729])
        _, raw = _rows(spec, schema, self, pilot_rng, PILOT_ROWS, _arrow_schema(schema))
        self.center, self.spread = float(raw.mean()), float(raw.std() + 1e-12)

    def drifted(self, angle: float) -> "_Teacher":
        """This teacher with its id vectors rotated by ``angle`` (radians) towards the
        second field (the dense part and the output scaling unchanged)."""
        teacher = copy.copy(self)
        teacher.angle = angle
        return teacher

    def embedding(self, feature: int, ranks: np.ndarray) -> np.ndarray:
        """float64 ``[len(ranks), TEACHER_DIM]``: the teacher's vector of each id."""
        if self.angle == 0.0:
            return self._field(feature, ranks, self.salt)
        return (math.cos(self.angle) * self._field(feature, ranks, self.salt)
                + math.sin(self.angle) * self._field(feature, ranks, self.salt ^ DRIFT_SALT))

    def _field(self, feature: int, ranks: np.ndarray, salt_base: int) -> np.ndarray:
        """One hashed vector field: float64 ``[len(ranks), TEACHER_DIM]``."""
        keys = (ranks.astype(np.uint64)[:, None] * np.uint64(TEACHER_DIM) + np.arange(TEACHER_DIM, dtype=np.uint64))
        salt = np.uint64((salt_base + feature * SALT) % (1 << 64))
        h = splitmix64(keys ^ salt)
        mask = np.uint64(0xFFFF)
        total = sum(((h >> np.uint64(s)) & mask).astype(np.float64) for s in (0, 16, 32, 48))
        gaussian = (total / 65535.0 - 2.0) * np.sqrt(3.0)
        rarity = 1.0 / (1.0 + ranks / RARITY_RANK)
        return gaussian * rarity[:, None]

    def pooled_mean(self, feature: int, ranks: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Mean of the bag's vectors (zeros for an empty bag): float64 ``[B, TEACHER_DIM]``."""
        emb = self.embedding(feature, ranks)
        bag = np.repeat(np.arange(lengths.size), lengths)
        pooled = np.stack([np.bincount(bag, emb[:, d], minlength=lengths.size) for d in range(TEACHER_DIM)], axis=1)
        return pooled / np.maximum(lengths, 1)[:, None]

    def raw_output(self, dense_log1p: np.ndarray, pooled: np.ndarray) -> np.ndarray:
        """Linear term plus MLP output, before rescaling: float64 ``[B]``."""
        x = np.concatenate([dense_log1p - 1.5, pooled * 2.0], axis=1)
        return x @ self.w_linear + np.maximum(x @ self.w1 + self.b1, 0.0) @ self.w2

    def probability(self, raw: np.ndarray) -> np.ndarray:
        """Click probability: raw outputs rescaled to the fixed logit spread and bias."""
        logits = LOGIT_SCALE * (raw - self.center) / self.spread + LOGIT_BIAS
        return 1.0 / (1.0 + np.exp(-logits))
