"""Tokenizers: the built-in byte-level tokenizer and loading of any local tokenizer.

`ByteTokenizer` maps text to its UTF-8 bytes (ids 0..255) plus three special tokens:
`<bos>` = 256, `<eos>` = 257, `<pad>` = 258. It needs no vocabulary file, so it works
offline everywhere, and it is a regular Hugging Face tokenizer: `save_pretrained`,
`from_pretrained`, padding, `batch_decode` and `AutoTokenizer` (after
`register_auto_tokenizer`) all work.

Text that happens to contain "<eos>" is encoded as its bytes, never as the special
token, so `tokenizer(text)` and the bulk path `encode_bytes(text)` always agree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizer
from transformers.tokenization_utils_base import AddedToken

from attnlab.errors import DataError
from attnlab.outputs import staged_files

BYTE_VOCAB_SIZE = 256
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<bos>", "<eos>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
_SPECIALS = {BOS_ID: BOS_TOKEN, EOS_ID: EOS_TOKEN, PAD_ID: PAD_TOKEN}

# Byte tokens are spelled "<0x41>" so that they never collide with added tokens.
_BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(BYTE_VOCAB_SIZE)]
_BYTE_IDS = {tok: i for i, tok in enumerate(_BYTE_TOKENS)}
_SPECIAL_IDS = {tok: i for i, tok in _SPECIALS.items()}

TOKENIZER_CONFIG = "tokenizer_config.json"


class ByteTokenizer(PreTrainedTokenizer):
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then `<bos>`, `<eos>`, `<pad>`."""

    vocab_files_names: dict[str, str] = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, add_bos_token: bool = False, **kwargs):
        self.add_bos_token = bool(add_bos_token)
        self._added_tokens_decoder = {
            i: AddedToken(tok, lstrip=False, rstrip=False, normalized=False, special=True)
            for i, tok in _SPECIALS.items()
        }
        kwargs.setdefault("bos_token", BOS_TOKEN)
        kwargs.setdefault("eos_token", EOS_TOKEN)
        kwargs.setdefault("pad_token", PAD_TOKEN)
        kwargs.setdefault("padding_side", "left")
        kwargs.setdefault("split_special_tokens", True)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs["special_tokens_pattern"] = "bos" if self.add_bos_token else "none"
        super().__init__(add_bos_token=self.add_bos_token, **kwargs)

    # --- vocabulary -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE + len(_SPECIALS)

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(_BYTE_IDS)
        vocab.update(_SPECIAL_IDS)
        vocab.update(self._added_tokens_encoder)
        return vocab

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # the vocabulary is fixed; tokenizer_config.json is all that is needed

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained into a new staging directory, each file then renamed into
        `save_directory`: a symlink planted at one of its names is replaced, never written through."""
        with staged_files(save_directory) as staging:
            files = super().save_pretrained(staging, *args, **kwargs)
            # The base class drops add_bos_token from the saved config; keep it.
            config_path = staging / TOKENIZER_CONFIG
            if config_path.is_file():
                config = json.loads(config_path.read_text(encoding="utf-8"))
                config["add_bos_token"] = self.add_bos_token
                config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return tuple(str(Path(save_directory) / Path(f).name) for f in files)

    # --- slow-path hooks --------------------------------------------------------------

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [_BYTE_TOKENS[b] for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        if token in _BYTE_IDS:
            return _BYTE_IDS[token]
        if token in _SPECIAL_IDS:
            return _SPECIAL_IDS[token]
        raise KeyError(f"{token!r} is not a byte token like '<0x41>' or one of {list(_SPECIAL_IDS)}")

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < BYTE_VOCAB_SIZE:
            return _BYTE_TOKENS[index]
        if index in _SPECIALS:
            return _SPECIALS[index]
        raise IndexError(f"token id {index} is outside the byte tokenizer's vocabulary (0..{len(self) - 1})")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for token in tokens:
            byte = _BYTE_IDS.get(token)
            if byte is not None:
                out.append(byte)
            else:
                out += token.encode("utf-8")
        return out.decode("utf-8", errors="replace")

    # --- fast path ---------------------------------------------------------------------

    def encode_bytes(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens) as a uint8 array; fast for megabytes."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def register_auto_tokenizer(config_class) -> None:
    """Let `AutoTokenizer` build a `ByteTokenizer` for models whose config is `config_class`."""
    AutoTokenizer.register(config_class, slow_tokenizer_class=ByteTokenizer, exist_ok=True)


def _names_byte_tokenizer(directory: Path) -> bool:
    config_path = directory / TOKENIZER_CONFIG
    if not config_path.is_file():
        return False
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"Cannot read tokenizer config {config_path}: {exc}. Fix or re-save the tokenizer.") from exc
    return isinstance(config, dict) and config.get("tokenizer_class") == ByteTokenizer.__name__


def load_tokenizer(spec: str):
    """Load a tokenizer: "byte" for the built-in one, or a local tokenizer directory.

    The result always has a pad token (the EOS token if it had none) and pads on the
    left, as decoder-only generation needs.
    """
    spec = str(spec)
    if spec == "byte":
        tokenizer = ByteTokenizer()
    else:
        directory = Path(os.path.expanduser(spec))
        if not directory.is_dir():
            raise DataError(
                f"Tokenizer {spec!r} is neither 'byte' nor an existing directory. Use 'byte' for the "
                "built-in byte tokenizer, or the path of a directory saved with save_pretrained "
                "(containing tokenizer_config.json and the tokenizer files)."
            )
        if _names_byte_tokenizer(directory):
            tokenizer = ByteTokenizer.from_pretrained(str(directory))
        else:
            try:
                tokenizer = AutoTokenizer.from_pretrained(
                    str(directory), local_files_only=True, trust_remote_code=False
                )
            except Exception as exc:  # transformers raises many types here
                raise DataError(
                    f"Cannot load a tokenizer from {directory}: {exc}. The directory must hold a tokenizer "
                    "saved with save_pretrained (tokenizer_config.json plus tokenizer.json or vocabulary files)."
                ) from exc
    return _prepare_for_lm(tokenizer, spec)


def _prepare_for_lm(tokenizer, spec: str):
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise DataError(
                f"Tokenizer {spec!r} has neither a pad token nor an EOS token. Add an EOS token to it "
                "(tokenizer.add_special_tokens({'eos_token': ...})) and save it again."
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer
