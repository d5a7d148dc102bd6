"""Charts of a benchmark run: PNGs drawn with matplotlib.

    python -m benchmarks --plots DIR               # measure, then draw the charts
    python -m benchmarks.plots REPORT.md DIR       # draw them from a saved report

Both draw from the same data: the live run hands over its raw numbers; a saved report
(``--out``) is read back from its tables, so the charts of a committed report can be
redrawn without measuring again. Every axis is logarithmic: the contenders differ by
orders of magnitude.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# Chart files, in the order the report shows them.
FILES = {
    "latency": "bench-latency.png",
    "throughput": "bench-throughput.png",
    "arrays": "bench-arrays.png",
    "startup": "bench-startup.png",
}
CAPTIONS = {
    "latency": "Trivial call round trip (median; the tick marks p99)",
    "throughput": "Pipelined calls, 100 in flight",
    "arrays": "A call with a numpy argument, by array size",
    "startup": "Actor start-up",
}
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _color(name: str) -> str:
    if name.startswith("actorshm"):
        return "#3949ab"  # the site's indigo
    if "floor" in name:
        return "#9e9e9e"
    return "#ef6c00"


def _bars(ax, names, values, *, unit, marks=None):
    ys = range(len(names))[::-1]
    ax.barh(list(ys), values, color=[_color(n) for n in names], height=0.6)
    if marks is not None:
        ax.plot(marks, list(ys), "|", color="black", markersize=14, markeredgewidth=1.5)
    ax.set_yticks(list(ys), names)
    ax.set_xscale("log")
    _log_limits(ax, list(values) + list(marks or []))
    ax.set_xlabel(unit)
    ax.grid(axis="x", which="both", alpha=0.25)
    ax.set_axisbelow(True)
    for y, v in zip(ys, values):
        ax.annotate(f"{v:,.0f}" if v >= 10 else f"{v:.2g}", (v, y), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)


def _log_limits(ax, values) -> None:
    """Room left of the shortest bar (so it shows) and right of the longest (labels)."""
    ax.set_xlim(min(values) / 2.5, max(values) * 3)


def _positive(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None and v > 0}


def write(data: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Draw the charts that ``data`` has numbers for into ``out_dir``; return their paths.

    Args:
        data: ``{"latency": {name: (median_s, p99_s)}, "throughput": {name: calls_per_s},
            "arrays": {name: {size_bytes: seconds}}, "startup": {name: {label: seconds}},
            "title": str}``; a missing key draws no chart.
        out_dir: the folder for the PNG files (created if missing).

    Raises:
        ImportError: matplotlib is not installed (``pip install -e '.[bench]'``).
    """
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - the test extra has it
        raise ImportError("--plots needs matplotlib: pip install -e '.[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = data.get("title", "")
    written = []

    def save(fig, key):
        fig.suptitle(CAPTIONS[key], fontsize=11, x=0.01, ha="left")
        if title:
            fig.text(0.01, 0.005, title, fontsize=7, color="#616161", ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.03 if title else 0, 1, 1))
        path = out / FILES[key]
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

    lat = {k: v for k, v in data.get("latency", {}).items() if v[0] > 0}
    if lat:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(lat) + 1.2))
        names = list(lat)
        _bars(ax, names, [lat[n][0] * 1e6 for n in names], unit="µs per call (log scale)",
              marks=[lat[n][1] * 1e6 for n in names])
        save(fig, "latency")
    thr = _positive(data.get("throughput", {}))
    if thr:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(thr) + 1.2))
        names = list(thr)
        _bars(ax, names, [thr[n] for n in names], unit="calls per second (log scale)")
        save(fig, "throughput")
    arrays = {k: _positive(v) for k, v in data.get("arrays", {}).items()}
    arrays = {k: v for k, v in arrays.items() if v}
    if arrays:
        fig, ax = plt.subplots(figsize=(10, 4.6))
        styles = iter(["-", "--", "-.", ":"] * 4)
        for name, per_size in arrays.items():
            sizes = sorted(per_size)
            ax.plot(sizes, [per_size[s] * 1e3 for s in sizes], marker="o",
                    linestyle=next(styles) if not name.startswith("actorshm") else "-",
                    linewidth=2.5 if name == "actorshm, shared argument" else 1.5,
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        every = sorted({s for v in arrays.values() for s in v})
        ax.set_xticks(every, [_size_label(s) for s in every], rotation=30,
                      ha="right", rotation_mode="anchor")
        ax.minorticks_off()
        ax.set_xlabel("array size")
        ax.set_ylabel("ms per call (log scale)")
        ax.grid(which="major", alpha=0.25)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        save(fig, "arrays")
    startup = {k: _positive(v) for k, v in data.get("startup", {}).items()}
    startup = {k: v for k, v in startup.items() if v}
    if startup:
        labels = list(dict.fromkeys(lbl for v in startup.values() for lbl in v))
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(startup) * len(labels) + 1.4))
        h = 0.8 / len(labels)
        names = list(startup)
        for i, lbl in enumerate(labels):
            ys = [len(names) - 1 - j - i * h + h * (len(labels) - 1) / 2
                  for j in range(len(names))]
            vals = [startup[n].get(lbl, 0) * 1e3 for n in names]
            ax.barh(ys, vals, height=h, label=lbl, color=["#3949ab", "#9fa8da"][i % 2])
            for y, v in zip(ys, vals):
                if v > 0:
                    ax.annotate(f"{v:,.0f}", (v, y), xytext=(4, 0), va="center",
                                textcoords="offset points", fontsize=8)
        ax.set_yticks(range(len(names))[::-1], names)
        ax.set_xscale("log")
        _log_limits(ax, [v * 1e3 for d in startup.values() for v in d.values()])
        ax.set_xlabel("ms until every actor answered (log scale)")
        ax.grid(axis="x", which="both", alpha=0.25)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, loc="upper right")
        save(fig, "startup")
    return written


def markdown(paths: list[Path], relative_to: str | os.PathLike | None,
             command: str) -> str:
    """The report's "Charts" section embedding ``paths``, as seen from ``relative_to``.

    Args:
        paths: the chart files ``write`` returned.
        relative_to: the folder of the report (None: the working directory).
        command: the command line of the run the charts show.
    """
    if not paths:
        return ""
    base = Path(relative_to) if relative_to is not None else Path.cwd()
    key_of = {v: k for k, v in FILES.items()}
    lines = ["### Charts\n",
             f"The numbers of the tables below, drawn by matplotlib: one run, `{command}`. "
             "Every axis is logarithmic. Redraw them from a saved report with "
             "`python -m benchmarks.plots REPORT.md DIR`.\n"]
    for p in paths:
        rel = Path(os.path.relpath(Path(p).resolve(), base.resolve())).as_posix()
        lines.append(f"![{CAPTIONS[key_of[Path(p).name]]}]({rel})\n")
    return "\n".join(lines) + "\n"


def _size_label(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= _UNITS[unit]:
            return f"{n // _UNITS[unit]} {unit}"
    return f"{n} B"


# -- reading a saved report back ------------------------------------------------------
def _sections(md: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    out = {}
    for block in re.split(r"^### ", md, flags=re.M)[1:]:
        title, _, body = block.partition("\n")
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
                for ln in body.splitlines() if ln.startswith("|")]
        if len(rows) >= 2:
            out[title.strip()] = (rows[0], rows[2:])
    return out


def _num(cell: str) -> float | None:
    m = re.match(r"\s*([\d,]*\.?\d+)", cell)
    return float(m.group(1).replace(",", "")) if m else None


def _find(sections, prefix):
    return next((v for k, v in sections.items() if k.startswith(prefix)), None)


def from_report(md: str) -> dict:
    """The chart data in a Markdown report written by ``python -m benchmarks --out``.

    Raises:
        ValueError: the text has none of the report's tables.
    """
    sections = _sections(md)
    data: dict = {}
    m = re.search(r"^Machine: (.*?)\.?$", md, flags=re.M)
    c = re.search(r"^Command: `(.*?)`", md, flags=re.M)
    if m:
        data["title"] = f"{c.group(1) + ', ' if c else ''}{m.group(1)}"
    t = _find(sections, "Trivial call round trip")
    if t:
        data["latency"] = {r[0]: (_num(r[1]) / 1e6, _num(r[2]) / 1e6) for r in t[1]}
    t = _find(sections, "Pipelined calls")
    if t:
        data["throughput"] = {r[0]: _num(r[1]) for r in t[1]}
    t = _find(sections, "A call with a numpy argument")
    if t:
        sizes = [int(h.split()[0]) * _UNITS[h.split()[1]] for h in t[0][1:]]
        data["arrays"] = {r[0]: {s: (_num(cell) or 0) / 1e3 for s, cell in zip(sizes, r[1:])
                                 if "ms" in cell} for r in t[1]}
    t = _find(sections, "Actor start-up")
    if t:
        labels = [h.removesuffix(" ms") for h in t[0][1:]]
        data["startup"] = {r[0]: {lbl: (_num(cell) or 0) / 1e3
                                  for lbl, cell in zip(labels, r[1:])} for r in t[1]}
    if not any(k in data for k in FILES):
        raise ValueError("no benchmark tables found: pass a report written by "
                         "`python -m benchmarks --out REPORT.md`")
    return data


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(description="Draw the charts of a saved benchmark report.")
    p.add_argument("report", help="a report written by `python -m benchmarks --out`")
    p.add_argument("out_dir", help="folder for the PNG files")
    args = p.parse_args(argv)
    try:
        data = from_report(Path(args.report).read_text())
    except (OSError, ValueError) as e:
        p.error(str(e))
    for path in write(data, args.out_dir):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
