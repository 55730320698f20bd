"""Directories are published whole (outputs.publishing): staged beside their destination, described by a
manifest, renamed into place; never written through a link planted at the staging name or the destination."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import attnlab.outputs as outputs
from attnlab.models.checkpoints import verify_checkpoint
from attnlab.outputs import MANIFEST, file_sha256, publish_dir, publishing


def _publish(dest, files: dict[str, bytes], **kwargs):
    with publishing(dest, **kwargs) as staging:
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
    return dest


def _leftovers(dest) -> list[str]:
    """Entries beside `dest` that are not `dest` itself: staging or old directories left behind."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name != dest.name)


def test_publishing_renames_the_staged_directory_into_place(tmp_path):
    dest = _publish(tmp_path / "model", {"config.json": b"{}", "model.safetensors": b"w" * 100})
    assert (dest / "config.json").read_bytes() == b"{}" and (dest / "model.safetensors").read_bytes() == b"w" * 100
    assert _leftovers(dest) == []


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    files = {"config.json": b"{}", "model.safetensors": b"w" * 100, "sub/dir/rng_state.pth": b"rng"}
    dest = _publish(tmp_path / "model", files)
    manifest = json.loads((dest / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(files)
    for rel, data in files.items():
        assert manifest["files"][rel] == {"bytes": len(data), "sha256": file_sha256(dest / rel)}
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted([*files, MANIFEST])


def test_the_manifest_records_the_step_and_readers_verify_against_it(tmp_path):
    assert verify_checkpoint(_publish(tmp_path / "step", {"model.safetensors": b"w"}, step=12)) == 12
    assert "step" not in json.loads((_publish(tmp_path / "adapter", {"a.json": b"{}"}) / MANIFEST).read_text())
    assert verify_checkpoint(tmp_path / "adapter") == 0


def test_a_new_publication_replaces_the_previous_directory_whole(tmp_path):
    dest = _publish(tmp_path / "final", {"old.bin": b"old", "shared.json": b"1"})
    _publish(dest, {"shared.json": b"2"})
    assert sorted(p.name for p in dest.iterdir()) == [MANIFEST, "shared.json"]
    assert (dest / "shared.json").read_bytes() == b"2" and _leftovers(dest) == []


def test_a_failed_write_leaves_the_previous_directory_intact_and_no_staging(tmp_path):
    dest = _publish(tmp_path / "final", {"model.safetensors": b"old"})
    with pytest.raises(RuntimeError, match="disk full"):
        with publishing(dest) as staging:
            (staging / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("disk full")
    assert (dest / "model.safetensors").read_bytes() == b"old" and verify_checkpoint(dest) == 0
    assert _leftovers(dest) == []


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from attnlab.outputs import publishing
    with publishing(sys.argv[1]) as staging:
        (staging / "model.safetensors").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_write_leaves_the_previous_directory_and_the_next_publish_removes_its_staging(tmp_path):
    dest = _publish(tmp_path / "final", {"model.safetensors": b"old"})
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(dest)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (dest / "model.safetensors").read_bytes() == b"old" and verify_checkpoint(dest) == 0
    assert len(_leftovers(dest)) == 1  # what the killed process was writing
    _publish(dest, {"model.safetensors": b"new"})
    assert (dest / "model.safetensors").read_bytes() == b"new" and _leftovers(dest) == []


def test_a_staging_directory_another_writer_still_holds_is_left_alone(tmp_path):
    dest = tmp_path / "gguf-hf"
    with pytest.raises(OSError):  # the other writer published the same copy first: this one's rename is refused
        with publishing(dest, replace=False) as first:
            (first / "config.json").write_bytes(b"{}")
            _publish(dest, {"config.json": b"{}"}, replace=False)  # a second writer starts and finishes meanwhile
            assert (first / "config.json").is_file()  # its staging directory was left alone
    assert (dest / "config.json").is_file() and _leftovers(dest) == []


def test_a_symlink_planted_at_the_staging_name_is_never_written_through(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.mkdir()
    dest = tmp_path / "out" / "model"
    dest.parent.mkdir()
    planted = dest.with_name(".model.000000000000.tmp")
    planted.symlink_to(victim, target_is_directory=True)
    names = iter([planted])
    fresh = outputs.temporary_name
    monkeypatch.setattr(outputs, "temporary_name", lambda path: next(names, None) or fresh(path))
    _publish(dest, {"config.json": b"{}"})
    assert list(victim.iterdir()) == [] and planted.is_symlink()  # the link is neither followed nor reused
    assert (dest / "config.json").is_file() and not dest.is_symlink()


@pytest.mark.parametrize("replace", [True, False])
def test_a_symlink_planted_at_the_destination_is_never_followed(tmp_path, replace):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep me")
    dest = tmp_path / "out" / "model"
    dest.parent.mkdir()
    dest.symlink_to(victim, target_is_directory=True)
    if replace:  # the link is moved aside and removed; the directory takes its place
        _publish(dest, {"config.json": b"{}"}, replace=True)
        assert dest.is_dir() and not dest.is_symlink() and (dest / "config.json").is_file()
    else:  # refused: nothing is renamed over a link
        with pytest.raises(OSError):
            _publish(dest, {"config.json": b"{}"}, replace=False)
        assert dest.is_symlink()
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"] and (victim / "keep.txt").read_text() == "keep me"
    assert _leftovers(dest) == []


def test_without_replace_a_destination_that_holds_files_is_refused_and_left_as_it_was(tmp_path):
    dest = _publish(tmp_path / "converted", {"config.json": b"theirs"})
    with pytest.raises(OSError):
        _publish(dest, {"config.json": b"ours"}, replace=False)
    assert (dest / "config.json").read_bytes() == b"theirs" and _leftovers(dest) == []


def test_without_replace_an_empty_directory_at_the_destination_is_taken(tmp_path):
    (tmp_path / "merged").mkdir()
    dest = _publish(tmp_path / "merged", {"config.json": b"{}"}, replace=False)
    assert (dest / "config.json").is_file() and _leftovers(dest) == []


def test_the_previous_directory_is_put_back_when_the_new_one_cannot_be_renamed_into_place(tmp_path, monkeypatch):
    dest = _publish(tmp_path / "final", {"model.safetensors": b"old"})
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"new")
    rename = os.rename

    def failing(src, dst):
        if str(src) == str(staging):
            raise OSError(28, "No space left on device")
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="No space"):
        publish_dir(staging, dest)
    assert (dest / "model.safetensors").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "staging"]
