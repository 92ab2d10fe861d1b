"""`shoal bench ab`: same-process A/B of the decode step's tunables, variants interleaved.

Why: two processes of the same code can time the same step a few percent apart although each
repeats its own step within 0.3%, so one process per variant cannot decide a 1-3% question. Here
one engine (one set of weights, one memory layout) times the step under every variant in turn,
round after round: the step is re-captured as a CUDA graph for each timing (`engine.decode_step_ms`)
under the variant's `shoal.tuning.Tuning`, built with `dataclasses.replace`; nothing is patched.

A variant is one or more changes joined by `+`, each `TABLE@KEY:field=value[,field=value]`:
- `attention@16:block_n=128,num_stages=4`: the decode attention config of batch bucket 16
  (`kernels.attention.TUNED_DECODE_CONFIGS`; `attention-fp8kv@...` the e4m3 KV cache's);
- `gemm@2560x9728x64:split_k=4`: the FP8 GEMM config of (N, K, M bucket)
  (`kernels.fp8_gemm.TUNED_CONFIGS_FP8`); `*` matches any value of a part (`gemm@*x*x1:...`);
- `step:head_kernel_max_rows=16` (or `kernel:...`): any `Tuning` field, and `max_top_k`, the
  sampling kernels' candidate count.
A GEMM variant that needs more split-K workspace than the engine reserved is reported, not run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from shoal.tuning import Tuning

# `step:` / `kernel:` fields: every `shoal.tuning.Tuning` field but the config tables, and the
# sampling kernels' candidate count (`DecodeStep.max_top_k`, from `EngineConfig.sample_max_top_k`).
STEP_ATTRIBUTES = frozenset({"max_top_k"})
STEP_SWITCHES = (
    frozenset(
        {item.name for item in dataclasses.fields(Tuning) if not item.name.endswith(("_configs", "_fp8_kv"))}
    )
    | STEP_ATTRIBUTES
)
KERNEL_SWITCHES = STEP_SWITCHES
TABLE_FIELDS = {
    "attention": "attention_configs", "attention-fp8kv": "attention_configs_fp8_kv", "gemm": "gemm_configs",
}  # fmt: skip


@dataclass(frozen=True)
class Change:
    table: str  # "attention", "attention-fp8kv", "gemm", "kernel" or "step"
    key: int | tuple[int, int, int] | None  # None for "step"
    fields: dict


def _tables() -> dict:
    from shoal.kernels.attention import TUNED_DECODE_CONFIGS, TUNED_DECODE_CONFIGS_FP8_KV
    from shoal.kernels.fp8_gemm import TUNED_CONFIGS_FP8

    return {
        "attention": TUNED_DECODE_CONFIGS, "attention-fp8kv": TUNED_DECODE_CONFIGS_FP8_KV,
        "gemm": TUNED_CONFIGS_FP8,
    }  # fmt: skip


def _value(text: str) -> int | bool:
    if text in ("True", "False", "true", "false"):
        return text.lower() == "true"
    return int(text)


def parse_fields(assignments: str) -> dict[str, int | bool]:
    """`name=value[,name=value...]` -> {name: int or bool} (a variant part's fields; also the
    config text of `scripts/probe_attention_configs.py`)."""
    fields = {}
    for assignment in assignments.split(","):
        name, value = assignment.split("=", 1)
        fields[name.strip()] = _value(value.strip())
    return fields


def parse_variant(spec: str) -> list[Change]:
    """`spec` (module docstring) -> its changes; ValueError with the offending part otherwise."""
    changes = []
    for part in spec.split("+"):
        try:
            head, assignments = part.split(":", 1)
            table, key_text = head.split("@", 1) if head not in ("step", "kernel") else (head, "")
            if table in ("step", "kernel"):
                key = None
            elif table in ("attention", "attention-fp8kv"):
                key: int | tuple[int, int, int] = int(key_text)
            elif table == "gemm":
                n, k, m = (None if v == "*" else int(v) for v in key_text.split("x"))
                key = (n, k, m)
            else:
                tables = "attention, attention-fp8kv, gemm, kernel or step"
                raise ValueError(f"unknown table {table!r} ({tables})")
            fields = parse_fields(assignments)
            if table == "step" and not fields.keys() <= STEP_SWITCHES:
                raise ValueError(f"step switches are {', '.join(sorted(STEP_SWITCHES))}")
            if table == "kernel" and not fields.keys() <= KERNEL_SWITCHES:
                raise ValueError(f"kernel switches are {', '.join(sorted(KERNEL_SWITCHES))}")
        except ValueError as error:
            raise ValueError(f"bad variant part {part!r}: {error}") from None
        changes.append(Change(table, key, fields))
    return changes


def concrete(changes: list[Change]) -> list[Change]:
    """Wildcard GEMM keys (None parts, from `*`) expanded to the table entries they match."""
    tables = _tables()
    expanded = []
    for change in changes:
        if change.table != "gemm" or None not in change.key:
            expanded.append(change)
            continue
        matches = [
            key for key in tables["gemm"]
            if all(want is None or want == have for want, have in zip(change.key, key, strict=True))
        ]  # fmt: skip
        if not matches:
            raise KeyError(f"gemm table has no entry matching {change.key}")
        expanded.extend(Change("gemm", key, change.fields) for key in matches)
    return expanded


def variant(base: Tuning, changes: list[Change]) -> Tuning:
    """`base` with `changes`: fields set, table entries replaced by modified copies (a key must
    already be in its table, a field must be one of its config's)."""
    tables = _tables()
    fields: dict = {}
    replaced = {name: dict(getattr(base, name)) for name in TABLE_FIELDS.values()}
    for change in changes:
        if change.table in ("step", "kernel"):
            fields.update({k: v for k, v in change.fields.items() if k not in STEP_ATTRIBUTES})
            continue
        table = tables[change.table]
        if change.key not in table:
            raise KeyError(f"{change.table} table has no entry {change.key}")
        entries = replaced[TABLE_FIELDS[change.table]]
        entries[change.key] = dataclasses.replace(entries.get(change.key, table[change.key]), **change.fields)
    return base.with_fields(**fields, **replaced)


@contextlib.contextmanager
def applied(changes: list[Change], step) -> Iterator[None]:
    """`step` (the engine's `DecodeStep`) runs the variant's tuning inside, its own afterwards."""
    saved_tuning, saved_top_k = step.tuning, getattr(step, "max_top_k", None)
    tuning = variant(saved_tuning, changes)
    try:
        for change in changes:
            if change.table in ("step", "kernel") and "max_top_k" in change.fields:
                step.max_top_k = change.fields["max_top_k"]
        step.tuning = tuning
        yield
    finally:
        step.tuning = saved_tuning
        if saved_top_k is not None:
            step.max_top_k = saved_top_k


def interleaved(names: list[str], rounds: int) -> list[str]:
    """The timing order: every variant once per round, the base first in each."""
    return [name for _ in range(rounds) for name in names]


def workspace_shortfall(core, changes: list[Change], batch: int) -> str | None:
    """Why a GEMM change cannot run at this batch (its split-K partials exceed the workspace the
    engine reserved before capture), or None. Checked before timing: a launch refused inside a
    graph capture would leave the capture broken."""
    from shoal.engine.fp8_weights import graph_row_counts
    from shoal.kernels.fp8_gemm import SplitKWorkspace, m_bucket

    fp8 = core.runner.step.fp8 if core.runner.step is not None else None
    workspace = getattr(fp8, "workspace", None)
    if workspace is None:
        return None
    tables = _tables()
    for change in changes:
        if change.table != "gemm":
            continue
        n, k, bucket = change.key
        config = dataclasses.replace(tables["gemm"][change.key], **change.fields)
        for m in graph_row_counts([batch]):
            if m_bucket(m) != bucket:
                continue
            partials, tiles = SplitKWorkspace.required(m, n, config)
            if partials > workspace.partials.numel() or tiles > workspace.counters.numel():
                need = f"{partials} partials and {tiles} tile counters"
                have = f"{workspace.partials.numel()} and {workspace.counters.numel()}"
                return f"{n}x{k} at M = {m} needs {need}, the workspace holds {have}"
    return None


def run_ab(
    batches: list[int], context: int, variants: dict[str, list[Change]], rounds: int,
    kv_cache_dtype: str = "auto", max_seq_len: int | None = None,
) -> dict:  # fmt: skip
    """{batch: {variant: [ms per round]}} with "base" the tables as they are; `max_seq_len` sizes
    the block tables (default: the engine bench's, context + a margin)."""
    from shoal.bench.engine import decode_step_ms, random_step_core

    core = random_step_core(batches, context, max_seq_len=max_seq_len, kv_cache_dtype=kv_cache_dtype)
    every = {"base": [], **variants}
    results: dict[int, dict[str, list[float]]] = {b: {name: [] for name in every} for b in batches}
    for batch in batches:
        runnable = []
        for name in every:
            why = workspace_shortfall(core, every[name], batch)
            if why is None:
                runnable.append(name)
            else:
                print(f"batch {batch} {name}: not run ({why})")
        for name in interleaved(runnable, rounds):
            with applied(every[name], core.runner.step):
                results[batch][name].append(decode_step_ms(core, [batch], context)[batch])
    return results


def print_table(results: dict) -> None:
    for batch, per_variant in results.items():
        base = statistics.median(per_variant["base"]) if per_variant["base"] else None
        print(f"batch {batch}: median step ms over rounds (ratio to base), all samples")
        for name, samples in per_variant.items():
            if not samples:
                continue
            median = statistics.median(samples)
            ratio = f"{median / base:.3f}" if base else "-"
            print(f"  {name:40} {median:7.3f} ({ratio})  {' '.join(f'{s:.3f}' for s in samples)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, default=332, help="keys per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument(
        "--max-seq-len", type=int, default=None,
        help="block table width in keys (default: context + 48, the engine bench's; `shoal serve`: 32768)",
    )  # fmt: skip
    parser.add_argument(
        "--variant", action="append", default=[], metavar="SPEC", help="see the module docstring; repeat"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    variants = {spec: concrete(parse_variant(spec)) for spec in args.variant}
    if not torch.cuda.is_available():
        print("the A/B bench needs a CUDA GPU")
        return 2
    results = run_ab(args.batch, args.context, variants, args.rounds, args.kv_cache_dtype, args.max_seq_len)
    print_table(results)
    return 0
