"""Checkpoints of a fused module: full and incremental chains restore exactly, the writer
works from a snapshot, corruption is named, old checkpoints are pruned."""

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer.checkpoint.helpers import assert_same_state, checkpointer, module, state, train_steps
from neorec.trainer.checkpoint.checkpointer import Checkpointer
from neorec.trainer.checkpoint.inspect import describe
from neorec.trainer.checkpoint.layout import CheckpointError, complete, read_manifest
from neorec.trainer.checkpoint.restore import choose, open_checkpoint, restore_embeddings
from neorec.trainer.embedding.fused import FusedEmbeddingBagCollection
from tests.cli import NEOREC, neorec_in_process


def _restored(root, **module_kwargs):
    fresh = module(seed=99, **module_kwargs)
    restorable = open_checkpoint(root)
    restore_embeddings(restorable, fresh.shard_views())
    fresh.set_optimizer_steps(restorable.manifest.sparse_steps)
    return fresh, restorable


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "fp16", "bf16"])
def test_a_chain_of_increments_restores_bit_exactly(tmp_path, optimizer, weight_dtype):
    embeddings = module(optimizer, weight_dtype)
    writer = checkpointer(tmp_path, embeddings, mode="incremental")
    for step in (1, 2, 3):
        train_steps(embeddings, 3, seed=step)
        writer.save(global_step=step, epoch=0, step_in_epoch=step, dense=None, wait=True)
    manifest = read_manifest(tmp_path / "step-000000003")
    assert manifest.kind == "incremental" and manifest.chain == ["step-000000001", "step-000000002", "step-000000003"]
    restored, _ = _restored(tmp_path, optimizer=optimizer, weight_dtype=weight_dtype)
    assert_same_state(state(restored), state(embeddings))


def _checkpointed(root: Path, steps, **config) -> tuple[FusedEmbeddingBagCollection, Checkpointer]:
    """A module trained one step before each of ``steps``, checkpointed after it under ``root``."""
    embeddings = module()
    writer = checkpointer(root, embeddings, **config)
    for step in steps:
        train_steps(embeddings, 1, seed=step)
        writer.save(global_step=step, epoch=0, step_in_epoch=step, dense=None, wait=True)
    return embeddings, writer


def test_an_increment_writes_only_the_modified_rows(tmp_path):
    embeddings = module()
    writer = checkpointer(tmp_path, embeddings)
    train_steps(embeddings, 2, seed=1)
    writer.save(global_step=1, epoch=0, step_in_epoch=1, dense=None, wait=True)
    train_steps(embeddings, 1, seed=2)
    touched = {t.name: int(embeddings.table_touched(t.name).sum()) for t in embeddings.tables}
    writer.save(global_step=2, epoch=0, step_in_epoch=2, dense=None, wait=True)
    full, increment = (read_manifest(tmp_path / n) for n in ("step-000000001", "step-000000002"))
    assert sum(r.count for r in full.records) == 1300
    assert {r.table: r.count for r in increment.records} == touched
    assert increment.stats["touched"] == touched
    assert increment.stats["bytes"] < full.stats["bytes"] / 3


def test_a_full_checkpoint_follows_when_increments_would_cost_more_to_restore(tmp_path):
    embeddings = module()
    writer = checkpointer(tmp_path, embeddings, keep=100)
    kinds = []
    for step in range(1, 30):
        train_steps(embeddings, 4, seed=step, batch=64)
        writer.save(global_step=step, epoch=0, step_in_epoch=step, dense=None, wait=True)
        kinds.append(read_manifest(tmp_path / f"step-{step:09d}").kind)
    assert kinds[0] == "full" and "incremental" in kinds and kinds[1:].count("full") >= 1
    for step, kind in enumerate(kinds, 1):  # no chain's increments write more rows than the model has
        manifest = read_manifest(tmp_path / f"step-{step:09d}")
        if kind == "incremental":
            rows = sum(sum(read_manifest(tmp_path / n).stats["touched"].values()) for n in manifest.chain[1:])
            assert rows <= 1300


def test_the_writer_writes_the_snapshot_not_what_training_does_next(tmp_path, monkeypatch):
    from neorec.trainer.checkpoint import writer as writer_module

    embeddings = module()
    train_steps(embeddings, 2, seed=1)
    expected = state(embeddings)
    release = __import__("threading").Event()
    original = writer_module._write_rank

    def slow(job):
        release.wait(10)
        return original(job)

    monkeypatch.setattr(writer_module, "_write_rank", slow)
    writer = checkpointer(tmp_path, embeddings)  # asynchronous by default
    writer.save(global_step=1, epoch=0, step_in_epoch=1, dense=None)
    train_steps(embeddings, 3, seed=7)  # training goes on while the checkpoint is written
    with torch.no_grad():
        embeddings.weights.add_(1.0)
    release.set()
    writer.close()
    restored, _ = _restored(tmp_path)
    assert torch.equal(restored.weights, expected["weights"])
    assert torch.equal(restored.state1, expected["state1"])


def test_a_corrupt_or_truncated_file_is_named_and_fallback_restores_the_one_before(tmp_path):
    embeddings = module()
    writer = checkpointer(tmp_path, embeddings, mode="full")
    train_steps(embeddings, 2, seed=1)
    writer.save(global_step=1, epoch=0, step_in_epoch=1, dense=None, wait=True)
    first = state(embeddings)
    train_steps(embeddings, 2, seed=2)
    writer.save(global_step=2, epoch=0, step_in_epoch=2, dense=None, wait=True)
    victim = tmp_path / "step-000000002" / "rank-00000.emb"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    views = module(seed=5).shard_views()
    with pytest.raises(CheckpointError, match=str(victim)):
        choose(tmp_path, views, agree=lambda ok: ok, fallback=False, need_dense=False)
    victim.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=f"{victim} is 100 bytes.*truncated"):
        choose(tmp_path, views, agree=lambda ok: ok, fallback=False, need_dense=False)
    fallen_back = choose(tmp_path, views, agree=lambda ok: ok, fallback=True, need_dense=False)
    assert fallen_back.manifest.name == "step-000000001"
    fresh = module(seed=5)
    restore_embeddings(fallen_back, fresh.shard_views())
    assert torch.equal(fresh.weights, first["weights"])


@pytest.mark.parametrize("damage,expected", [
    ({"chain": ["../../etc", "step-000000002"]}, "is not a list of checkpoint names"),
    ({"chain": ["step-000000002"]}, "does not lead from a full checkpoint"),
    ({"chain": ["step-000000003", "step-000000002"]}, "does not lead from a full checkpoint"),
    ({"step": "x"}, "step is 'x', not a whole number"),
    ({"step": 7}, "name 'step-000000002' is not that of step 7"),
    ({"name": "step-000000001", "step": 1, "chain": ["step-000000001"], "kind": "full"}, "not of the directory"),
])
def test_a_manifest_whose_position_or_chain_no_checkpoint_writes_is_named(tmp_path, damage, expected):
    embeddings, writer = _checkpointed(tmp_path, (1, 2), mode="incremental")
    path = tmp_path / "step-000000002" / "manifest.json"
    obj = json.loads(path.read_text())
    assert obj["chain"] == ["step-000000001", "step-000000002"]
    path.write_text(json.dumps({**obj, **damage}))
    with pytest.raises(CheckpointError, match=f"{path}.*{re.escape(expected)}"):  # restoring it
        open_checkpoint(tmp_path)
    listed = describe(tmp_path)["checkpoints"][-1]  # inspecting it: listed as corrupt, the error named
    assert listed["verified"] is False and re.search(f"{path}.*{re.escape(expected)}", listed["error"])


def test_inspect_verify_fails_a_checkpoint_whose_chain_is_not_complete(tmp_path):
    embeddings, writer = _checkpointed(tmp_path, (1, 2), mode="incremental")
    (tmp_path / "step-000000001" / "manifest.json").unlink()
    [verified] = describe(tmp_path, verify=True)["checkpoints"]
    assert verified["name"] == "step-000000002" and not verified["verified"]
    assert "step-000000001 is not a complete checkpoint" in verified["error"]


def test_inspect_verify_marks_every_increment_on_a_corrupt_base_and_the_command_exits_2(tmp_path):
    embeddings, writer = _checkpointed(tmp_path, (1, 2, 3), mode="incremental")
    base = tmp_path / "step-000000001"
    damaged = next(p for p in sorted(base.iterdir()) if p.name != "manifest.json" and p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    checkpoints = describe(tmp_path, verify=True)["checkpoints"]
    assert [c["verified"] for c in checkpoints] == [False, False, False]
    assert f"{damaged}" in checkpoints[0]["error"]
    assert all(c["error"].startswith(f"restored from step-000000001, which is not whole: {damaged}")
               for c in checkpoints[1:])
    command = subprocess.run([*NEOREC, "checkpoint", "inspect", "--verify", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
    assert command.returncode == 2 and "Traceback" not in command.stderr, command.stderr
    assert command.stderr.strip() == (f"neorec: error: 3 checkpoints of 3 in {tmp_path} cannot be restored: "
                                      "step-000000001, step-000000002, step-000000003")


@pytest.mark.parametrize("dynamic", [False, True])
def test_inspect_verify_judges_a_base_s_corrupt_dense_state_as_the_restore_does(tmp_path, dynamic):
    """A chain's older ``dense.pt`` is read by a restore only where dynamic tables keep their
    id maps incrementally; the increments on it are restorable exactly when it is not read."""
    embeddings = module()
    writer = checkpointer(tmp_path, embeddings, run_config={"model": {"dynamic": {"t0": {}}}} if dynamic else None)
    for step in (1, 2):
        train_steps(embeddings, 1, seed=step)
        writer.save(global_step=step, epoch=0, step_in_epoch=step, dense={"step": torch.tensor([step])}, wait=True)
    dense = tmp_path / "step-000000001" / "dense.pt"
    data = bytearray(dense.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dense.write_bytes(bytes(data))
    base, increment = describe(tmp_path, verify=True)["checkpoints"]
    assert not base["verified"] and f"{dense} does not match its checksum" in base["error"]
    assert increment["verified"] is not dynamic
    views = module().shard_views()
    if dynamic:
        assert increment["error"] == f"restored from step-000000001, which is not whole: {base['error']}"
        with pytest.raises(CheckpointError, match=f"{dense} does not match its checksum"):
            choose(tmp_path, views, agree=lambda ok: ok, fallback=False, need_dense=True)
    else:
        assert choose(tmp_path, views, agree=lambda ok: ok, fallback=False, need_dense=True).manifest.name == \
            "step-000000002"


@pytest.mark.parametrize("damage", ["truncated", "wrong types"])
def test_inspect_lists_a_checkpoint_whose_manifest_is_damaged_as_corrupt_beside_the_others(tmp_path, damage):
    embeddings, writer = _checkpointed(tmp_path, (1, 2), mode="full")
    manifest = tmp_path / "step-000000002" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[:60] if damage == "truncated" else json.dumps({**json.loads(text), "tables": "x"}))
    (tmp_path / "LATEST").write_bytes(b"step-\xff\n")  # not UTF-8 either
    listed = describe(tmp_path)["checkpoints"]
    assert [c["name"] for c in listed] == ["step-000000001", "step-000000002"] and "step" in listed[0]
    assert listed[1]["verified"] is False and listed[1]["error"].startswith(f"{manifest}: cannot be read")
    command = neorec_in_process("checkpoint", "inspect", tmp_path)
    assert command.returncode == 2 and "step-000000002   CORRUPT:" in command.stdout, command.stdout
    assert command.stderr.strip() == \
        f"neorec: error: 1 checkpoint of 2 in {tmp_path} cannot be restored: step-000000002"


def test_old_checkpoints_are_pruned_but_not_the_chains_that_are_kept(tmp_path):
    embeddings, writer = _checkpointed(tmp_path, range(1, 6), keep=2)
    names = [p.name for p in complete(tmp_path)]
    newest = read_manifest(tmp_path / names[-1])
    assert set(newest.chain) <= set(names)  # the chain of the newest is whole
    assert len(names) == len(set(newest.chain) | {names[-2]} | set(read_manifest(tmp_path / names[-2]).chain))
    assert (tmp_path / "LATEST").read_text().strip() == names[-1]
    restored, _ = _restored(tmp_path)
    assert_same_state(state(restored), state(embeddings))


def test_a_checkpoint_whose_manifest_is_corrupt_is_kept_aside_by_the_pruning_that_follows(tmp_path):
    """A resume with checkpoint.fallback skipped it; the run's next commits must not stop on it."""
    embeddings, writer = _checkpointed(tmp_path, (1, 2), keep=2, mode="full")
    corrupt = tmp_path / "step-000000002" / "manifest.json"
    corrupt.write_text(corrupt.read_text()[:50])
    for step in (3, 4, 5):
        train_steps(embeddings, 1, seed=step)
        writer.save(global_step=step, epoch=0, step_in_epoch=step, dense=None, wait=True)
    assert [p.name for p in complete(tmp_path)] == ["step-000000004", "step-000000005"]  # pruned as usual after


@pytest.mark.parametrize("bits,tolerance", [(16, 1e-3), (8, 0.02), (4, 0.2)])
def test_quantized_checkpoints_restore_within_their_precision(tmp_path, bits, tolerance):
    embeddings = module()
    train_steps(embeddings, 3, seed=1)
    writer = checkpointer(tmp_path, embeddings, bits=bits)
    writer.save(global_step=1, epoch=0, step_in_epoch=1, dense=None, wait=True)
    restored, _ = _restored(tmp_path)
    for t in embeddings.tables:
        a, b = embeddings.table_weight(t.name), restored.table_weight(t.name)
        spread = (a.max(dim=1).values - a.min(dim=1).values).max()
        assert (a - b).abs().max() <= tolerance * spread
    assert torch.equal(restored.state1, embeddings.state1)  # optimizer state is never quantized
    manifest = json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
    assert manifest["bits"] == bits
    assert np.isfinite(restored.weights.numpy()).all()


@pytest.mark.slow
def test_killing_the_writer_at_any_point_leaves_the_newest_complete_checkpoint_whole(tmp_path):
    """SIGKILL a process that checkpoints continuously, at 24 random moments, restarting it
    each time from the newest complete checkpoint: every restore is exactly the state of
    its step, and no incomplete checkpoint is ever taken for a complete one."""
    import random
    import subprocess
    import sys
    import time

    from tests.trainer.checkpoint import crash_writer

    rng = random.Random(0)
    steps_seen = []
    for attempt in range(24):
        process = subprocess.Popen([sys.executable, "-m", "tests.trainer.checkpoint.crash_writer", str(tmp_path)],
                                   stdout=subprocess.PIPE, text=True)
        line = process.stdout.readline()
        assert line.startswith("ready"), line
        time.sleep(rng.uniform(0.0, 0.3))
        process.kill()
        process.wait()
        if not complete(tmp_path):  # killed before its first commit (a loaded machine): only ever at the start
            assert not steps_seen, f"attempt {attempt}: the complete checkpoints of earlier attempts are gone"
            continue
        restorable = open_checkpoint(tmp_path)
        step = restorable.manifest.step
        restored = crash_writer.fresh()
        restore_embeddings(restorable, restored.shard_views())
        restored.set_optimizer_steps(restorable.manifest.sparse_steps)
        expected = crash_writer.state_after(step)
        for key in ("weights", "state1", "optimizer_step"):
            assert torch.equal(state(restored)[key], expected[key]), (attempt, step, key)
        steps_seen.append(step)
    # Each restart goes on from the newest complete checkpoint: never back, and forward overall (how far
    # depends on how fast the machine is, not on the checkpoints).
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] > steps_seen[0]
