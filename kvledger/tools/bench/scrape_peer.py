"""Part `peer` of `kvledger bench scrape`: the render against a peer, prometheus-client (the
installed version), on the same series.

kvledger's render of a republished scrape (written as text format 0.0.4 like the peer),
`generate_latest` over a registry of plain Gauges holding the series kvledger rendered, and
`generate_latest` over a `MultiProcessCollector` merging one mmap file per rank (how SGLang
serves its own /metrics). Interleaved round by round, CPU of this process per render, the
ratio kvledger/peer paired by round; judged: kvledger/generate_latest <= 1.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Literal, cast, get_args

from kvledger.tools.bench.scrape_ranks import rank_files

# prometheus-client's Gauge multiprocess modes.
MultiprocessMode = Literal[
    "all",
    "liveall",
    "min",
    "livemin",
    "max",
    "livemax",
    "sum",
    "livesum",
    "mostrecent",
    "livemostrecent",
]
MULTIPROCESS_MODES: tuple[str, ...] = get_args(MultiprocessMode)
# The format prometheus-client's `generate_latest` writes; kvledger's render is asked for the
# same, so that the two write the same lines.
PEER_ACCEPT = "text/plain;version=0.0.4"
PEER_VARIANTS = ("kvledger", "generate_latest", "multiprocess")
PEER_TARGET_RATIO = 1.0  # kvledger/generate_latest, median of the ratios paired by round
# Which file a series goes to in the multiprocess peer: its rank's, by this label; a series
# without it (the exporter's own) goes to the first rank's file.
RANK_LABEL = "tp_rank"

# One series: (help text, sample name, label names, label values, value).
_Series = tuple[str, str, tuple[str, ...], tuple[str, ...], float]


def exposition_series(text: str) -> list[_Series]:
    """Every sample of a text-format-0.0.4 exposition, in order."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[_Series] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names = tuple(sample.labels)
            values = tuple(sample.labels[n] for n in names)
            out.append((family.documentation, sample.name, names, values, float(sample.value)))
    return out


def series_keys(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """(sample name, sorted labels) of every sample of a text-format-0.0.4 exposition."""
    return {
        (name, tuple(sorted(zip(ln, lv, strict=True))))
        for _, name, ln, lv, _ in exposition_series(text)
    }


def _set_gauges(
    series: list[_Series], registry: Any, multiprocess_mode: MultiprocessMode = "all"
) -> None:
    """One prometheus-client Gauge per sample name (a counter's `_total`, a histogram's
    `_bucket`, `_sum` and `_count` each a gauge of that name), every series of `series`
    set on it with its labels; registered in `registry` (None: in no registry)."""
    from prometheus_client import Gauge

    by_name: dict[str, tuple[str, tuple[str, ...], list[tuple[tuple[str, ...], float]]]] = {}
    for doc, name, labelnames, labelvalues, value in series:
        entry = by_name.setdefault(name, (doc, tuple(sorted(labelnames)), []))
        if entry[1] != tuple(sorted(labelnames)):
            raise ValueError(f"{name}: label names {labelnames} and {entry[1]} in one exposition")
        labels = dict(zip(labelnames, labelvalues, strict=True))
        entry[2].append((tuple(labels[n] for n in entry[1]), value))
    for name, (doc, labelnames, rows) in by_name.items():
        gauge = Gauge(name, doc, labelnames, registry=registry, multiprocess_mode=multiprocess_mode)
        for values, value in rows:
            (gauge.labels(*values) if labelnames else gauge).set(value)


def _write_multiprocess_files(
    directory: str, series: list[_Series], ranks: list[str], multiprocess_mode: MultiprocessMode
) -> None:
    """Each rank's series written into its own mmap file in `directory`, as that rank's
    process would with PROMETHEUS_MULTIPROC_DIR set: values backed by
    `prometheus_client.values.MultiProcessValue` with the rank as process identifier.
    prometheus-client's global value class and the environment are restored after."""
    from prometheus_client import values

    owner = {rank: i for i, rank in enumerate(ranks)}
    per_rank: list[list[_Series]] = [[] for _ in ranks]
    for s in series:
        labels = dict(zip(s[2], s[3], strict=True))
        per_rank[owner.get(labels.get(RANK_LABEL, ""), 0)].append(s)
    saved_class, saved_env = values.ValueClass, os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    try:
        for i, rank_series in enumerate(per_rank):
            values.ValueClass = values.MultiProcessValue(lambda i=i: i)
            _set_gauges(rank_series, None, multiprocess_mode)
    finally:
        values.ValueClass = saved_class
        if saved_env is None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_env
        values.close_all_multiprocess_files()


@contextlib.contextmanager
def _torch_one_thread() -> Any:
    """torch pinned to one thread while it runs, where this process has loaded torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)


def _ms_stats(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def _ratio_stats(ratios: list[float]) -> dict[str, float]:
    return {
        "n": len(ratios),
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }


def bench_peer(
    ranks: int, budget: int, rounds: int, multiprocess_mode: str = "mostrecent"
) -> dict[str, Any]:
    """kvledger's render of a republished scrape against prometheus-client's
    `generate_latest`, plain and multiprocess, on the same series, interleaved round by
    round (the order rotated every round); CPU of this process (and wall) per render."""
    from importlib.metadata import version

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from exporter.collector import KvLedgerCollector
    from exporter.sources import Sources

    if multiprocess_mode not in MULTIPROCESS_MODES:
        raise ValueError(
            f"bench_peer: multiprocess_mode={multiprocess_mode!r}, expected one of "
            f"{', '.join(MULTIPROCESS_MODES)}"
        )
    mode = cast(MultiprocessMode, multiprocess_mode)

    with contextlib.ExitStack() as stack:
        torch_threads = stack.enter_context(_torch_one_thread())
        directory, _, republish = rank_files(stack, ranks, budget)
        sources = Sources(directory)
        renderer = KvLedgerCollector(sources)
        text = renderer.render(PEER_ACCEPT)[0].decode()
        series = exposition_series(text)
        ranks_seen = {
            labels[RANK_LABEL]
            for labels in (dict(zip(s[2], s[3], strict=True)) for s in series)
            if RANK_LABEL in labels
        }
        rank_values = sorted(ranks_seen, key=lambda v: (len(v), v)) or ["0"]
        plain = CollectorRegistry(auto_describe=False)
        _set_gauges(series, plain)
        mp_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvledger-bench-mp-"))
        _write_multiprocess_files(mp_dir, series, rank_values, mode)
        merged = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(merged, path=mp_dir)

        def kvledger() -> bytes:
            return renderer.render(PEER_ACCEPT)[0]

        render: dict[str, Callable[[], bytes]] = {
            "kvledger": kvledger,
            "generate_latest": lambda: generate_latest(plain),
            "multiprocess": lambda: generate_latest(merged),
        }
        keys = series_keys(text)
        out: dict[str, Any] = {
            "prometheus_client": version("prometheus_client"),
            "format": PEER_ACCEPT,
            "ranks": ranks,
            "rounds": rounds,
            "series": len(series),
            "multiprocess_files": len(os.listdir(mp_dir)),
            "multiprocess_mode": multiprocess_mode,
            "torch_threads": torch_threads,
        }
        for name in PEER_VARIANTS[1:]:
            peer_text = render[name]().decode()
            out[f"{name}_series"] = len(exposition_series(peer_text))
            out[f"{name}_same_series"] = series_keys(peer_text) == keys

        cpu: dict[str, list[float]] = {name: [] for name in PEER_VARIANTS}
        wall: dict[str, list[float]] = {name: [] for name in PEER_VARIANTS}
        warmup = min(10, rounds)
        parses = 0
        for i in range(warmup + rounds):
            if i == warmup:
                parses = sources.read().files.parses  # files unchanged since: parses none
            k = i % len(PEER_VARIANTS)
            for name in PEER_VARIANTS[k:] + PEER_VARIANTS[:k]:
                if name == "kvledger":
                    republish()  # every rank's file changed since kvledger's last render
                c0, t0 = time.process_time(), time.perf_counter()
                render[name]()
                t1, c1 = time.perf_counter(), time.process_time()
                if i >= warmup:
                    wall[name].append(t1 - t0)
                    cpu[name].append(c1 - c0)
        out["files_parsed_per_kvledger_render"] = (sources.read().files.parses - parses) / rounds
        for name in PEER_VARIANTS:
            out[name] = _ms_stats(cpu[name])
            out[name]["wall_median_ms"] = statistics.median(wall[name]) * 1000
        for name in PEER_VARIANTS[1:]:
            out[f"ratio_{name}"] = _ratio_stats(
                [k / max(p, 1e-9) for k, p in zip(cpu["kvledger"], cpu[name], strict=True)]
            )
        out["target_ratio"] = PEER_TARGET_RATIO
        out["target_met"] = out["ratio_generate_latest"]["median"] <= PEER_TARGET_RATIO
    return out


def report_peer(p: dict[str, Any]) -> list[str]:
    kv, gl, mp = (p[name] for name in PEER_VARIANTS)
    rg, rm = p["ratio_generate_latest"], p["ratio_multiprocess"]
    same = f"{p['generate_latest_series']}/{p['multiprocess_series']} series" + (
        ", the same names and labels"
        if p["generate_latest_same_series"] and p["multiprocess_same_series"]
        else ", NOT the same names and labels"
    )
    torch_note = "torch pinned to 1 thread" if p["torch_threads"] else "torch not loaded"
    lines = [
        f"render vs prometheus-client {p['prometheus_client']} (same {p['series']} series, "
        f"{p['ranks']} ranks): kvledger {kv['median_ms']:.3f} ms, generate_latest "
        f"{gl['median_ms']:.3f} ms, multiprocess {mp['median_ms']:.3f} ms; ratio "
        f"kvledger/generate_latest {rg['median']:.3f}, kvledger/multiprocess {rm['median']:.3f}",
        f"  CPU of this process per render, medians; {p['rounds']} rounds interleaved (order "
        f"rotated every round), every rank republished before kvledger's render; text format "
        f"0.0.4 all three; {torch_note}",
    ]
    for label, st in (
        ("kvledger render (republished)", kv),
        ("generate_latest (plain Gauges)", gl),
        (f"multiprocess ({p['multiprocess_files']} files, {p['multiprocess_mode']})", mp),
    ):
        lines.append(
            f"  {label:38s} median {st['median_ms']:8.3f} ms  min {st['min_ms']:8.3f}  "
            f"max {st['max_ms']:8.3f}  wall median {st['wall_median_ms']:8.3f}  (n={st['n']})"
        )
    for label, r in (("kvledger/generate_latest", rg), ("kvledger/multiprocess", rm)):
        lines.append(
            f"  ratio {label:30s} by round: median {r['median']:.3f}  min {r['min']:.3f}  "
            f"max {r['max']:.3f}  (n={r['n']})"
        )
    lines += [
        f"  peers rendered {same}; kvledger parsed "
        f"{p['files_parsed_per_kvledger_render']:g} files per render",
        f"  target kvledger/generate_latest <= {p['target_ratio']:g} (median of the paired "
        f"ratios): {'met' if p['target_met'] else 'NOT met'}",
    ]
    return lines
