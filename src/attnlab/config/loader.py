"""Load a run config from YAML, apply dotted `--set` overrides, validate, save."""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from attnlab.errors import ConfigError
from attnlab.outputs import replace_file

from .schema import RunConfig

FREE_FORM = ("model.mixer_options", "eval.generation")  # dict-valued fields: any sub-key is accepted here, checked by the mixer


def default_config_path() -> Path:
    return Path(str(resources.files("attnlab") / "configs" / "default.yaml"))


def valid_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, e.g. 'train.lr'."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(valid_keys(annotation, key + "."))
        else:
            keys.append(key)
    return keys


# Names users bring from other tools, mapped to ours.
ALIASES = {
    "learning_rate": "lr", "per_device_train_batch_size": "batch_size", "micro_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum", "max_grad_norm": "grad_clip", "clip_grad": "grad_clip",
    "save_steps": "save_every", "eval_steps": "eval_every", "logging_steps": "log_every",
    "steps": "max_steps", "num_steps": "max_steps", "warmup": "warmup_steps", "lr_scheduler_type": "schedule",
    "n_layer": "num_layers", "n_layers": "num_layers", "n_head": "num_heads", "n_embd": "hidden_size",
    "d_model": "hidden_size", "dim": "hidden_size", "block_size": "seq_len", "max_seq_len": "seq_len",
    "attention_type": "mixer", "attn_type": "mixer", "dtype": "precision", "save_total_limit": "keep_last",
}


def _suggest(key: str, candidates: list[str] | None = None) -> str:
    candidates = candidates or valid_keys()
    section, _, leaf = key.rpartition(".")
    name, colon, value = leaf.partition(":")
    if colon and name and value:  # YAML's {task:mqar} is one key 'task:mqar'
        return f"; YAML reads '{leaf}' as one key: write '{name}: {value}', with a space after the colon"
    if leaf in ALIASES:
        named = [c for c in candidates if c.endswith("." + ALIASES[leaf])]
        if named:
            return f"; did you mean '{named[0]}'?"
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
    if not close:  # compare the last component: 'train.learning_rate' vs 'lr' is hopeless, 'batchsize' is not
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(candidates)}"


def load_yaml(text: str, origin: str) -> Any:
    """`yaml.safe_load`, except that a mapping with a key given twice is a ConfigError naming the key
    and both lines (PyYAML keeps the last one without a word, so a forgotten earlier line wins silently)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, "", origin)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, prefix: str, origin: str, seen: set[int] | None = None) -> None:
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already checked (and no endless walk through a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = f"{prefix}{key_node.value}"
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise ConfigError(f"{origin}: key '{key}' is given twice, at lines {first_line[key]} and {line}; "
                                      "keep one of them (YAML would silently use the last).")
                first_line[key] = line
                _refuse_duplicate_keys(value_node, key + ".", origin, seen)
            else:
                _refuse_duplicate_keys(value_node, prefix, origin, seen)
    elif isinstance(node, yaml.SequenceNode):
        for n, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{prefix.removesuffix('.')}[{n}].", origin, seen)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}. Pass an existing YAML file, or no argument for the built-in default.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        data = load_yaml(text, str(path))
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"YAML syntax error in {path}{where}: {problem}. Fix the file and run again.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping with sections model/data/train, not a {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """'train.lr=1e-3' -> ('train.lr', 0.001). Values are read as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. train.lr=1e-3), got '{item}'")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_numeric(value):  # YAML reads '3e-4' as a string
        value = float(value)
    return key, value


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def apply_overrides(data: dict[str, Any], overrides: list[str], schema: type[BaseModel] = RunConfig,
                    free_form: tuple[str, ...] = FREE_FORM) -> dict[str, Any]:
    """Set each dotted KEY=VALUE of `overrides` in `data`; keys must exist in `schema` (or lie under `free_form`)."""
    candidates = valid_keys(schema)
    known = set(candidates)
    for item in overrides:
        key, value = parse_override(item)
        if key not in known and not any(key.startswith(p + ".") for p in free_form):
            raise ConfigError(f"unknown config key '{key}' in --set{_suggest(key, candidates)}")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"cannot set '{key}': '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return data


def _format_validation_error(err: ValidationError, origin: str, schema: type[BaseModel] | None = None) -> str:
    """One line per problem; unknown keys get the closest key of `schema` (default: the run config)."""
    candidates = valid_keys(schema) if schema is not None else None
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{key}'{_suggest(key, candidates)}")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = e["msg"].removeprefix("Value error, ")
            field = msg.split(" ", 1)[0]
            if key and f"{key}.{field}" in (candidates or valid_keys()):  # a section's check about one of its fields
                lines.append(f"{key}.{msg}")
            else:
                lines.append(f"{key}: {msg}{got_text}" if key else msg)
    return f"invalid config ({origin}):\n  " + "\n  ".join(lines)


def describe_origin(path: str | Path | None, overrides: list[str] | None) -> str:
    """Where a config came from, for messages: the file (or the built-in defaults) and the --set overrides."""
    where = str(path) if path is not None else "the built-in defaults"
    return where + (f" with --set {' '.join(overrides)}" if overrides else "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The resolved config of a run: the YAML file (or the built-in default) plus overrides."""
    source = Path(path) if path is not None else default_config_path()
    data = apply_overrides(_read_yaml(source), list(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, describe_origin(path, overrides))) from None


def validate_section(cls: type[BaseModel], data: dict[str, Any], origin: str):
    """Validate `data` as `cls`, turning pydantic's report into one ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin, cls)) from None


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def save_config(cfg: RunConfig, path: Path) -> None:
    replace_file(path, config_to_yaml(cfg))


def diff_configs(old: RunConfig, new: RunConfig, keys: tuple[str, ...]) -> list[str]:
    """Human-readable differences between two configs, restricted to `keys` (sections or dotted fields)."""
    flat_old, flat_new = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    out = []
    for k in sorted(set(flat_old) | set(flat_new)):
        if any(k == p or k.startswith(p + ".") for p in keys) and flat_old.get(k) != flat_new.get(k):
            out.append(f"{k}: {flat_old.get(k)!r} -> {flat_new.get(k)!r}")
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat
