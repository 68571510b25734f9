"""The figures of ``jpfs bench aggregate``: rounds merged into one row per (via, epoch, RTT),
ratios to local, the target ratios, the printed table and the chart."""

from __future__ import annotations

import os
from typing import Any

from .harness import fmt_rate, print_table


def merge_rounds(raw: list[dict]) -> list[dict]:
    """One row per (via, epoch, RTT): the round with the median GB/s (so its latencies and CPU
    figures belong together), with every round's GB/s and files/s alongside."""
    groups: dict[tuple, list[dict]] = {}
    for r in raw:
        groups.setdefault((r["via"], r["epoch"], r["rtt_ms"]), []).append(r)
    out = []
    for rs in groups.values():
        mid = sorted(rs, key=lambda r: r["GBps"])[len(rs) // 2]
        out.append({**mid, "rounds": len(rs),
                    "GBps_rounds": [r["GBps"] for r in rs],
                    "files_per_s_rounds": [r["files_per_s"] for r in rs],
                    "page_cache_dropped_by_others": any(r["page_cache_dropped_by_others"]
                                                        for r in rs)})
    return out


def check(row: dict) -> None:
    """Raise RuntimeError unless an epoch's row read every expected file and byte, without errors
    or a timeout (a faster run that read less is no result)."""
    if row["n_errors"] or row["timed_out"]:
        raise RuntimeError(f"{row['via']} epoch {row['epoch']}: {row['n_errors']} read "
                           f"error(s){' and a timeout' if row['timed_out'] else ''}: "
                           f"{row['errors'][:5]}")
    if row["files"] != row["expected_files"] or row["bytes"] != row["expected_bytes"]:
        raise RuntimeError(f"{row['via']} epoch {row['epoch']}: read {row['files']} files / "
                           f"{row['bytes']} bytes, expected {row['expected_files']} / "
                           f"{row['expected_bytes']}")


def add_ratios(rows: list[dict]) -> None:
    """Each row's GB/s and files/s against local in the same epoch (local has no RTT)."""
    for r in rows:
        base = next((b for b in rows if b["via"] == "local" and b["epoch"] == r["epoch"]), None)
        r["vs_local"] = None if base is None or r["via"] == "local" else {
            "GBps": r["GBps"] / base["GBps"] if base["GBps"] else None,
            "files_per_s": r["files_per_s"] / base["files_per_s"] if base["files_per_s"]
            else None}


def targets(rows: list[dict]) -> dict:
    """The issue's target ratios, where this run measured them (None otherwise)."""
    def get(via: str, epoch: int, rtt: float | None = None) -> dict | None:
        cands = [r for r in rows if r["via"] == via and r["epoch"] == epoch
                 and (r["rtt_ms"] or 0) == (rtt or 0)]
        return cands[0] if cands else None

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and b[key] else None

    last = max((r["epoch"] for r in rows), default=1)
    warm = last if last > 1 else None
    out: dict[str, Any] = {}
    if warm:
        out["native_warm_GBps_vs_local"] = ratio(get("native", warm), get("local", warm), "GBps")
        out["fuse_warm_GBps_vs_local"] = ratio(get("fuse", warm), get("local", warm), "GBps")
    out["native_cold_GBps_vs_local"] = ratio(get("native", 1), get("local", 1), "GBps")
    out["fuse_epoch1_files_prefetch_vs_none"] = ratio(get("fuse", 1), get("fuse-noprefetch", 1),
                                                      "files_per_s")
    rtts = sorted({r["rtt_ms"] for r in rows if r["rtt_ms"]})
    for rtt in rtts:
        for via in ("fuse", "native", "fuse-noprefetch"):
            for ep in (1, warm) if warm else (1,):
                k = f"{via}_epoch{ep}_files_rtt{rtt:g}ms_vs_rtt0"
                v = ratio(get(via, ep, rtt), get(via, ep, 0.0), "files_per_s")
                if v is not None:
                    out[k] = v
    return out


TARGETS = {
    "native_warm_GBps_vs_local": ("native warm GB/s vs local warm", None),
    "fuse_warm_GBps_vs_local": ("FUSE warm GB/s vs local warm", None),
    "native_cold_GBps_vs_local": ("native cold GB/s vs local cold", None),
    "fuse_epoch1_files_prefetch_vs_none": ("FUSE epoch 1 files/s, prefetch vs none", None),
}


def report(result: dict) -> None:
    """Print the table, the epoch-1 cache notes and the ratios."""
    rows = result["results"]
    headers = ["via", "epoch", "GB/s", "files/s", "vs local", "p50 ms", "p99 ms",
               "CPU s/GB cli", "srv", "prefetch"]
    has_rtt = any(r["rtt_ms"] is not None for r in rows)
    if has_rtt:
        headers.insert(1, "rtt")
    table = []
    for r in rows:
        vs = r.get("vs_local")
        state = "cold" if r["cold"] else ("warm" if r["epoch"] > 1 else "not cold")
        if r["page_cache_dropped_by_others"]:
            state += "*"
        row = [r["via"], f"{r['epoch']} {state}",
               f"{r['GBps']:.2f}", fmt_rate(r["files_per_s"]),
               "-" if not vs or vs["GBps"] is None else f"{vs['GBps']:.2f}x",
               _f(r["latency_ms"]["p50"]), _f(r["latency_ms"]["p99"]),
               _f(r["client_cpu_s_per_GB"]), _f(r["server_cpu_s_per_GB"]),
               "-" if r["prefetch_hit_rate"] is None else f"{r['prefetch_hit_rate']:.0%}"]
        if has_rtt:
            row.insert(1, "-" if r["rtt_ms"] is None else f"{r['rtt_ms']:g}ms")
        table.append(row)
    print()
    rounds = f"; median of {result['rounds']} rounds" if result["rounds"] > 1 else ""
    print_table(headers, table, title=f"aggregate reads: {result['dataset']['files']} files, "
                f"{result['dataset']['bytes'] / 1e9:.2f} GB, {result['readers']} reader "
                f"process(es){rounds}; load {result['load_avg']}")
    notes = sorted({r["cache"] for r in rows if r["epoch"] == 1})
    print("epoch 1 caches: " + "; ".join(notes))
    if any(r["page_cache_dropped_by_others"] for r in rows):
        print("* another process dropped the page cache during this measurement (shared "
              "machine): its figure is not what its label says")
    t = {k: v for k, v in result["targets"].items() if v is not None}
    if t:
        print("ratios:")
        for k, v in t.items():
            label = TARGETS.get(k, (k.replace("_", " "), None))[0]
            goal = " (target >= 0.50)" if k.startswith("fuse_") and "_rtt" in k \
                and "noprefetch" not in k else ""
            print(f"  {label}: {v:.2f}x{goal}")


def _f(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def plot(result: dict, path: str) -> None:
    """Grouped bars: GB/s and files/s per via, epoch (and RTT), with ratios to local."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    groups = []
    for r in rows:
        g = (r["epoch"], r["rtt_ms"] or 0)
        if g not in groups:
            groups.append(g)
    vias = list(dict.fromkeys(r["via"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(vias))
    for ax, key, label in ((axes[0], "GBps", "GB/s"), (axes[1], "files_per_s", "files/s")):
        for j, via in enumerate(vias):
            xs, ys, tags = [], [], []
            for i, (ep, rtt) in enumerate(groups):
                r = next((x for x in rows if x["via"] == via and x["epoch"] == ep
                          and (x["rtt_ms"] or 0) == rtt), None)
                if r is None and via == "local":
                    r = next((x for x in rows if x["via"] == "local" and x["epoch"] == ep),
                             None)
                if r is None:
                    continue
                xs.append(i + (j - (len(vias) - 1) / 2) * width)
                ys.append(r[key])
                vs = r.get("vs_local")
                tags.append((f"{vs[key]:.2f}x" if vs and vs.get(key) else "")
                            + ("*" if r.get("page_cache_dropped_by_others") else ""))
            bars = ax.bar(xs, ys, width, label=via)
            for b, tag in zip(bars, tags, strict=True):
                if tag:
                    ax.annotate(tag, (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"epoch {ep} ({'cold' if ep == 1 else 'warm'})"
                            + (f"\nrtt {rtt:g} ms" if rtt else "") for ep, rtt in groups],
                           fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    ds = result["dataset"]
    fig.suptitle(f"jpfs bench aggregate: {ds['files']} files, {ds['bytes'] / 1e9:.2f} GB, "
                 f"{result['readers']} readers; ratios vs local, same epoch; load "
                 f"{result['load_avg'][0]:g} on {os.cpu_count()} CPUs", fontsize=10)
    if any(r.get("page_cache_dropped_by_others") for r in rows):
        fig.text(0.01, 0.01, "* another process dropped the page cache during this measurement",
                 fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
