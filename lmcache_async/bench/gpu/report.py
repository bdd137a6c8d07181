"""The text table of a GPU benchmark run (``lmcache-async bench --gpu`` prints it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_async.bench import format_finite, format_table

__all__ = ["format_gpu"]


def _done(part: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """A part's figures, or ``None`` when it failed or did not run."""
    return None if part is None or "error" in part else part


def _missing(part: Mapping[str, Any] | None) -> str:
    return "not run" if part is None else f"FAILED: {part['error']}"


def _exact(part: Mapping[str, Any] | None) -> str:
    if part is None:
        return "n/a"
    return "yes" if part["verified_bit_exact"] else "NO"


def format_gpu(results: Mapping[str, Any]) -> str:
    """The human-readable table of :func:`~lmcache_async.bench.gpu.run_gpu_bench` results
    (a part that failed or did not run shows as one row saying so)."""
    cuda = bool(results["cuda"])

    def status(ok: bool) -> str:
        if not cuda:
            return "n/a (cpu)"
        return "ok" if ok else "below target"

    copy = _done(results.get("copy"))
    lw = _done(results.get("layerwise"))
    rows: list[list[str]] = []
    if copy is None:
        rows.append(["D2H store / H2D retrieve", _missing(results.get("copy")), "", "", "", ""])
    else:
        mib = copy["bytes"] / 1024**2
        for key, name in (("d2h", "D2H store"), ("h2d", "H2D retrieve")):
            e = copy[key]
            rows.append(
                [
                    f"{name} {copy['tokens']} tok ({mib:.0f} MiB)",
                    f"{format_finite(e['engine_gbps'], '.2f')} GB/s",
                    f"pinned copy_ {format_finite(e['raw_gbps'], '.2f')} GB/s",
                    f"{format_finite(e['ratio'], '.2f')}x",
                    f">= {e['target_ratio']:.1f}x",
                    status(e["ok"]),
                ]
            )
        for key, name in (("d2h", "D2H"), ("h2d", "H2D")):
            rows.append(
                [
                    f"pinned memcpy {name}, no gather",
                    f"{format_finite(copy[f'memcpy_{key}_gbps'], '.2f')} GB/s",
                    "",
                    "",
                    "(info)",
                    "",
                ]
            )
    if lw is None:
        rows.append(["layerwise retrieve", _missing(results.get("layerwise")), "", "", "", ""])
    else:
        rows.append(
            [
                f"layerwise retrieve {lw['layers']} layers",
                f"{format_finite(lw['hidden_fraction'] * 100, '.1f')}% hidden",
                f"serial {format_finite(lw['serial_ms'], '.2f')} ms, "
                f"overlap {format_finite(lw['overlap_ms'], '.2f')} ms",
                "",
                f">= {lw['target_hidden'] * 100:.0f}%",
                status(lw["ok"]),
            ]
        )
    staged = _done(results.get("staged"))
    if staged is None:
        rows.append(["staged gather / scatter", _missing(results.get("staged")), "", "", "", ""])
    else:
        for key in ("gather", "scatter"):
            e = staged[key]
            for way, label in (("staged", ""), ("staged_apart", ", payloads apart")):
                ratio = e["speedup"] if way == "staged" else e["apart_speedup"]
                rows.append(
                    [
                        f"staged {key} {staged['chunks']} chunks{label}",
                        f"{format_finite(e[f'{way}_gbps'], '.2f')} GB/s",
                        f"per chunk {format_finite(e['per_chunk_gbps'], '.2f')} GB/s",
                        f"{format_finite(ratio, '.2f')}x",
                        "(info)",
                        "",
                    ]
                )
    opts = results["options"]
    lines = ["lmcache-async GPU bench"]
    if results["note"]:
        lines.append("NOTE: " + results["note"])
    lines += [
        f"device: {results['device']} ({results['device_name']}), torch "
        f"{results['torch_version']}, CUDA {results['torch_cuda']}",
        f"model: {opts['num_layers']} layers x {opts['num_kv_heads']} kv heads x "
        f"{opts['head_size']} ({opts['dtype']}), block {opts['block_size']}, "
        f"{results['token_bytes'] / 1024:.1f} KiB per token",
        f"figures: {results['method']}",
        "",
        format_table(["figure", "value", "baseline", "ratio", "target", "status"], rows),
        "",
    ]
    if lw is not None:
        lines.append(
            f"layerwise: transfer {format_finite(lw['transfer_ms'], '.2f')} ms "
            f"({format_finite(lw['transfer_gbps'], '.2f')} GB/s), "
            f"compute {format_finite(lw['compute_ms'], '.2f')} ms "
            f"({lw['matmuls_per_layer']} x {lw['matmul_dim']}^2 {lw['matmul_dtype']} matmul per "
            f"layer), hidden = (serial - overlap) / transfer; at most "
            f"{format_finite(lw['hideable_fraction'] * 100, '.0f')}% can hide behind this compute"
        )
    if staged is not None:
        copies = staged["host_copies"]
        lines.append(
            f"staged: {staged['chunks']} chunks of {staged['chunk_size']} tokens in one batch, "
            f"a staging buffer of {staged['staging_bytes'] / 1024**2:.0f} MiB; host copies "
            f"per batch {copies['together']} (payloads back to back), {copies['apart']} (apart)"
        )
    lines.append(
        "bit-exact: retrieve "
        + _exact(copy)
        + ", layerwise retrieve "
        + _exact(lw)
        + ", staged "
        + _exact(staged)
    )
    problems = results["problems"]
    if problems:
        lines.append("problems: " + "; ".join(problems))
    lines.append(f"total {results['seconds']:.1f} s")
    return "\n".join(lines)
