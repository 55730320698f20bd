"""Checkpoints are published atomically, verified on resume and rotated."""

import os

import pytest

from attnlab.errors import CheckpointError
from attnlab.train.checkpoint import CheckpointManager, verify_checkpoint


def _stage(manager: CheckpointManager, step: int, payload: bytes = b"weights") -> "os.PathLike":
    staged = manager.staging / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(payload * 100)
    (staged / "trainer_state.json").write_text('{"global_step": %d}' % step)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):  # what a resume restores
        (staged / name).write_bytes(b"state")
    return staged


def test_publish_renames_staging_into_a_step_directory_and_points_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    final = manager.publish(_stage(manager, 20), 20)
    assert final.name == "step-0000020" and final.is_dir()
    assert os.readlink(manager.root / "latest") == "step-0000020"
    assert not (manager.staging / "checkpoint-20").exists()
    assert verify_checkpoint(final) == 20


def test_only_the_last_k_checkpoints_are_kept(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        manager.publish(_stage(manager, step), step)
    assert [s for s, _ in manager.checkpoints()] == [20, 30]


def test_a_staging_directory_is_never_a_resume_point(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.publish(_stage(manager, 10), 10)
    _stage(manager, 20)  # a write interrupted before publication
    assert manager.resume_point().name == "step-0000010"


def test_resume_with_no_checkpoint_refuses(tmp_path):
    with pytest.raises(CheckpointError, match="nothing to resume"):
        CheckpointManager(tmp_path).resume_point()


def test_truncated_checkpoint_file_is_detected(tmp_path):
    manager = CheckpointManager(tmp_path)
    final = manager.publish(_stage(manager, 10), 10)
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="model.safetensors has 50 bytes.*truncated"):
        manager.resume_point()


def test_corrupted_checkpoint_file_is_detected(tmp_path):
    manager = CheckpointManager(tmp_path)
    final = manager.publish(_stage(manager, 10), 10)
    weights = final / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        manager.resume_point()


def test_checkpoint_without_manifest_is_incomplete(tmp_path):
    manager = CheckpointManager(tmp_path)
    final = manager.publish(_stage(manager, 10), 10)
    (final / "attnlab_manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        manager.resume_point()
