"""The README's first command: `attnlab train` with no argument trains the built-in default to < 3 bits per byte."""

import json
import shutil
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_attnlab_train_with_no_argument_reaches_under_3_bits_per_byte(tmp_path):
    exe = shutil.which("attnlab")
    cmd = [exe] if exe else [sys.executable, "-m", "attnlab.cli"]
    run = tmp_path / "default"
    proc = subprocess.run([*cmd, "train", "--run-dir", str(run)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = json.loads((run / "run.json").read_text())
    print(f"default job: {status['wall_s']:.1f} s of training, validation {status['val_bpb']:.3f} bits/byte")
    assert status["status"] == "finished"
    assert status["val_bpb"] < 3.0
    assert "sample continuation" in proc.stdout
    assert str(run) in proc.stdout
