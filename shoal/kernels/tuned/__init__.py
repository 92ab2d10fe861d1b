"""The tuned kernel tables as data files, read once at import by the modules that use them.

The sweeps write their winners here (`shoal bench attention|gemm --sweep --write-table`, `shoal
bench engine --fp8-sweep --write-table`); which measurement chose an entry, and what it traded, is
in docs/performance.md's ledgers. Config entries hold only the fields that differ from the config
class's defaults.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

TABLE_DIR = Path(__file__).parent
ATTENTION_DECODE = "attention_decode.json"  # {"bf16" | "fp8_kv": {batch bucket: AttentionConfig fields}}
FP8_GEMM = "fp8_gemm.json"  # {"w8a16" | "w8a8": [{n, k, m bucket, GemmConfig fields}]}
FP8_VARIANTS = "fp8_variants.json"  # [{n, k, m bucket, variant}]: engine/fp8_weights.py's variants


def read_table(name: str) -> Any:
    """A table as shipped in the package (works from a wheel as from a checkout)."""
    return json.loads(resources.files(__name__).joinpath(name).read_text(encoding="utf-8"))


def config_fields(config: Any) -> dict[str, Any]:
    """A config dataclass as the fields that differ from its class's defaults: a table entry."""
    return {
        item.name: getattr(config, item.name)
        for item in dataclasses.fields(config)
        if item.default is dataclasses.MISSING or getattr(config, item.name) != item.default
    }


def update_table(name: str, change: Callable[[Any], Any], directory: Path | None = None) -> Path:
    """Write `change(table)` to `directory/name` (default: the package's own file), the table
    read from there when it exists, else the shipped one; returns the path written."""
    path = (directory or TABLE_DIR) / name
    table = json.loads(path.read_text(encoding="utf-8")) if path.exists() else read_table(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_table(change(table)) + "\n", encoding="utf-8")
    return path


def keyed_entries(entries: list[dict], winners: dict[tuple, dict], key_names: tuple[str, ...]) -> list[dict]:
    """`entries` (dicts whose `key_names` fields form their key) with `winners` {key: fields}
    replacing or adding entries, sorted by key."""
    merged = {tuple(entry[name] for name in key_names): entry for entry in entries}
    for key, fields in winners.items():
        merged[key] = {**dict(zip(key_names, key, strict=True)), **fields}
    return [merged[key] for key in sorted(merged)]


def format_table(value: Any, depth: int = 0) -> str:
    """JSON with one table entry (a mapping or list of scalars) per line, so a sweep's diff shows
    the entries it changed."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    if not any(isinstance(child, dict | list) for child in children):
        return json.dumps(value)
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, dict):
        lines = [f"{inner}{json.dumps(str(k))}: {format_table(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(lines) + f"\n{pad}}}"
    lines = [inner + format_table(item, depth + 1) for item in value]
    return "[\n" + ",\n".join(lines) + f"\n{pad}]"
