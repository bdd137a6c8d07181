"""The text table of a micro-benchmark run (``lmcache-async bench --micro`` prints it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_async.bench import format_finite, format_table
from lmcache_async.bench.micro.hashing import HASH_ALGORITHMS

__all__ = ["format_micro"]


def _status(ok: bool) -> str:
    return "ok" if ok else "below target"


def format_micro(results: Mapping[str, Any]) -> str:
    """The human-readable table of :func:`~lmcache_async.bench.micro.run_micro` results."""
    copy = results["copy"]
    mib = copy["bytes"] / 1024**2
    rows: list[list[str]] = []
    for name, baseline in (("store", "raw gather"), ("retrieve", "raw scatter")):
        e = copy[name]
        rows.append(
            [
                f"{name} {copy['tokens']} tok ({mib:.0f} MiB)",
                f"{format_finite(e['engine_gbps'], '.2f')} GB/s",
                f"{baseline} {format_finite(e['raw_gbps'], '.2f')} GB/s",
                f"{format_finite(e['ratio'], '.2f')}x",
                f">= {e['target_ratio']:.1f}x",
                _status(e["ok"]),
            ]
        )
    lookup = results["lookup"]
    for name in ("tensor", "list", "tensor_first_sight"):
        e = lookup[name]
        rows.append(
            [
                f"lookup {lookup['tokens']} tok ({name.replace('_', ' ')}) p50",
                f"{format_finite(e['p50_ms'], '.3f')} ms",
                f"p99 {format_finite(e['p99_ms'], '.3f')} ms",
                "",
                f"<= {lookup['target_p50_ms']:g} ms",
                _status(e["ok"]),
            ]
        )
    hashing = results["hashing"]
    for algorithm in HASH_ALGORITHMS:
        entry = hashing[algorithm]
        for name in ("list", "tensor"):
            is_default = algorithm == "blake3"
            target = hashing[f"target_{name}_mtps"]
            plain = name == "tensor"
            rows.append(
                [
                    f"hash {algorithm} ({name})",
                    f"{format_finite(entry[f'{name}_mtps'], '.1f')} M tok/s",
                    f"plain chain {format_finite(entry['tensor_plain_mtps'], '.1f')} M/s"
                    if plain
                    else "",
                    f"{format_finite(entry['tensor_ratio'], '.2f')}x" if plain else "",
                    f">= {target:g} M/s" if is_default else "(info)",
                    _status(entry[f"{name}_ok"]) if is_default else "",
                ]
            )
    over = copy["overhead"]
    for name in ("store", "retrieve"):
        value = over[f"{name}_overhead_us"]
        rows.append(
            [
                f"overhead {over['tokens']}-tok {name}",
                f"{format_finite(value, '.0f')} us",
                f"engine {format_finite(over[f'{name}_engine_us'], '.0f')} - raw "
                f"{format_finite(over[f'{name}_raw_us'], '.0f')} us",
                "",
                f"<= {over['target_us']:g} us",
                _status(value <= over["target_us"]),
            ]
        )
    for name, verb in (("store", "gather"), ("retrieve", "scatter")):
        rows.append(
            [
                f"{over['chunks']} chunks vs 1 buffer ({name})",
                f"{format_finite(over[f'{name}_raw_us'] - over[f'{name}_raw_whole_us'], '.0f')} us",
                f"raw {verb} {format_finite(over[f'{name}_raw_whole_us'], '.0f')} us",
                "",
                "(info)",
                "",
            ]
        )
    opts = results["options"]
    lines = [
        "lmcache-async micro bench",
        f"model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), {results['token_bytes'] / 1024:.1f} KiB per "
        f"token; torch threads: {results['torch_threads']}",
        f"figures: {results['method']}",
        "",
        format_table(["figure", "value", "baseline", "ratio", "target", "status"], rows),
        "",
        "retrieve bit-exact: " + ("yes" if copy["verified_bit_exact"] else "NO"),
        "blake3 key chain: "
        + (
            "in C (lmcache_async._native)"
            if hashing.get("native_chain")
            else "the blake3 package (the package was built without its C chain)"
        ),
    ]
    problems = results["problems"]
    if problems:
        lines.append("problems: " + "; ".join(problems))
    lines.append(f"total {results['seconds']:.1f} s")
    return "\n".join(lines)
