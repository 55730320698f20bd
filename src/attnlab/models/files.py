"""Checks of a model directory's files made before anything is built or allocated from them.

A `config.json` whose sizes are not positive integers or describe a model too large to hold, and a
`*.safetensors` file whose header does not fit the file (truncated, a header length beyond the file, tensor
offsets outside it or disagreeing with their dtype and shape), are refused with one CheckpointError naming
the file and the field, before transformers or safetensors allocate anything from them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from attnlab.errors import CheckpointError

# Sizes a model config gives (attnlab's names and the usual HF ones): each, when present, a positive integer.
SIZE_FIELDS = ("vocab_size", "hidden_size", "d_model", "n_embd", "num_layers", "num_hidden_layers", "n_layer", "num_heads",
               "num_attention_heads", "n_head", "num_key_value_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
               "n_positions")
NON_NEGATIVE_FIELDS = ("intermediate_size", "n_inner")  # 0 = blocks without an MLP (attnlab)
MAX_PARAMETERS = 10**12
LAYER_FIELDS = ("num_layers", "num_hidden_layers", "n_layer")
MAX_LAYERS = 10_000  # each layer is a Python module built one by one: millions of them never finish building
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header

# bytes per element of each safetensors dtype (sub-byte float formats are not checked for size)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def read_json_object(path: Path, what: str = "model config") -> dict:
    """The JSON object in `path`; a file that is not UTF-8 JSON holding an object is a CheckpointError naming it."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not a {what} (byte {e.start} is not UTF-8 text; it is not JSON); "
                              "restore it from the original model or checkpoint") from None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore it from the original model or checkpoint") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object; restore it from the original model or checkpoint")
    return value


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _first(config: dict, *names: str) -> Any:
    return next((config[n] for n in names if config.get(n) is not None), None)


def estimated_parameters(config: dict) -> int:
    """A rough count of the parameters a decoder LM of this config holds (embeddings, head, attention-sized
    mixers and MLPs); enough to tell a model that fits from one that cannot."""
    vocab = _first(config, "vocab_size") or 0
    hidden = _first(config, "hidden_size", "d_model", "n_embd") or 0
    layers = _first(config, "num_layers", "num_hidden_layers", "n_layer") or 0
    inner = _first(config, "intermediate_size", "n_inner")
    inner = round(8 / 3 * hidden) if inner is None else inner
    tied = config.get("tie_word_embeddings", True) is not False
    return vocab * hidden * (1 if tied else 2) + layers * (4 * hidden * hidden + 3 * hidden * inner)


# The sizes an attnlab model cannot be built without.
ATTNLAB_REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_heads")


def check_model_config(config: dict, path: Path, required: tuple[str, ...] = ()) -> None:
    """Refuse a config whose sizes are not positive integers (`required` ones given, not null), or whose model
    could not be held: more than 10^12 parameters, or more bytes (at 2 a parameter) than this machine's memory.
    `path` names the file."""
    if required == () and config.get("model_type") == "attnlab":
        required = ATTNLAB_REQUIRED
    for name in SIZE_FIELDS + NON_NEGATIVE_FIELDS:
        value = config.get(name)
        if value is None:
            if name in required:
                raise CheckpointError(f"{path}: {name} is {'null' if name in config else 'missing'}; it must be a positive integer. "
                                      "Restore the file from the original model")
            continue
        lowest = 0 if name in NON_NEGATIVE_FIELDS else 1
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{path}: {name} is {value!r}, not an integer; restore the file from the original model")
        if value < lowest:
            raise CheckpointError(f"{path}: {name} is {value}, it must be {'at least 0' if lowest == 0 else 'positive'}; "
                                  "restore the file from the original model")
        if name in LAYER_FIELDS and value > MAX_LAYERS:
            raise CheckpointError(f"{path}: {name} is {value:,}, more than the {MAX_LAYERS:,} layers attnlab builds; "
                                  "the file is damaged or not this model's config")
    params = estimated_parameters(config)
    memory = _memory_bytes()
    sizes = ", ".join(f"{n} {config[n]:,}" for n in ("vocab_size", "hidden_size", "num_layers", "num_hidden_layers",
                                                     "intermediate_size") if isinstance(config.get(n), int))
    if params > MAX_PARAMETERS:
        raise CheckpointError(f"{path} describes a model of about {params:.2g} parameters ({sizes}), more than the "
                              f"{MAX_PARAMETERS:.0e} attnlab loads; the file is damaged or not this model's config")
    if memory is not None and 2 * params > memory:
        raise CheckpointError(f"{path} describes a model of about {params:.2g} parameters ({sizes}): "
                              f"{2 * params / 2**30:,.0f} GiB even in 16-bit, more than this machine's {memory / 2**30:,.0f} GiB of memory; "
                              "the file is damaged or the model is too large for this machine")


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header does not describe its bytes: shorter than 8 bytes, a header
    length beyond the file, a header that is not a JSON object, a tensor without a known dtype, an integer
    shape or offsets inside the data, or whose byte length disagrees with its dtype and shape."""
    again = "the file is truncated or damaged: download, copy or convert it again"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} holds {size} bytes, less than a safetensors header; {again}")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8 or length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: its header length says {length:,} bytes, but the file holds {size:,} bytes "
                                      f"{'in all' if length > size - 8 else f'(a header is at most {MAX_HEADER_BYTES:,})'}; {again}")
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path}: its header is not valid JSON; {again}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its header is a JSON {type(header).__name__}, not an object; {again}")
    data_bytes = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} is described by a {type(info).__name__}, not an object; {again}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise CheckpointError(f"{where} has no dtype; {again}")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers; {again}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of integers; {again}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise CheckpointError(f"{where}: data_offsets [{begin:,}, {end:,}] lie outside the file's {data_bytes:,} bytes "
                                  f"of tensor data; {again}")
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{where}: {end - begin:,} bytes for a {dtype} tensor of shape {shape} "
                                  f"({math.prod(shape) * DTYPE_BYTES[dtype]:,} bytes); {again}")


def check_model_files(directory: Path) -> None:
    """`check_model_config` on `directory`'s config.json and `check_safetensors` on each of its safetensors files."""
    config = directory / "config.json"
    if config.is_file():
        check_model_config(read_json_object(config), config)
    for weights in sorted(directory.glob("*.safetensors")):
        check_safetensors(weights)
