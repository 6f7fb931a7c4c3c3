#!/usr/bin/env python3
"""Draw or tabulate `decodepack bench --json` results, with a baseline's beside them.

  chart.py OUT.png BENCH.json [--baseline BASELINE.json] [--title TITLE]   a PNG (needs matplotlib)
  chart.py --table BENCH.json [--baseline BASELINE.json]                    a text table (no matplotlib)

Both files follow manifests/bench-result.schema.json (bench/baseline.py writes the baseline's). The chart
has one column per layer class and one for the whole step; the top row is the share of the HBM read
ceiling each implementation reached (its own ceiling, measured in its run), the bottom row microseconds
per layer (per step for the whole step), per batch width, the baseline's bars hatched beside decodepack's
and the speedup (baseline time / decodepack time) written above each pair. Classes or widths that were not
timed (the correctness gate failed, no program) are left empty and named in the table.
"""

import argparse
import json
import sys

FORMAT = "decodepack-bench"
STEP = "whole step"


def load(path):
    with open(path) as f:
        r = json.load(f)
    if r.get("format") != FORMAT:
        sys.exit("%s: not a decodepack bench result (format %r, expected %r)" % (path, r.get("format"), FORMAT))
    if r.get("format_version") != 1:
        sys.exit("%s: bench result format_version %r; this script reads 1" % (path, r.get("format_version")))
    return r


def figures(r):
    """{(class, width): (us, share, status, reason)}; the whole step under STEP (us per step)."""
    out = {}
    for c in r.get("classes", []):
        ok = c["status"] == "ok"
        out[(c["class"], c["width"])] = (c["us_per_layer"]["median"] if ok else None, c["share"] if ok else None,
                                         c["status"], c.get("reason", ""))
    for s in r.get("steps", []):
        ok = s["status"] == "ok"
        out[(STEP, s["width"])] = (s["us"]["median"] if ok else None, s["share"] if ok else None, s["status"],
                                   s.get("reason", ""))
    return out


def columns(dp, base):
    classes = sorted({k[0] for k in dp if k[0] != STEP} | {k[0] for k in (base or {}) if k[0] != STEP})
    if any(k[0] == STEP for k in dp) or any(k[0] == STEP for k in (base or {})):
        classes.append(STEP)
    widths = sorted({k[1] for k in dp} | {k[1] for k in (base or {})})
    return classes, widths


def fmt_us(v):
    return "-" if v is None else "%.1f" % v


def fmt_share(v):
    return "-" if v is None else "%.1f%%" % (100 * v)


def table(dp_result, base_result=None):
    dp, base = figures(dp_result), figures(base_result) if base_result else None
    classes, widths = columns(dp, base)
    lines = []
    ceil = dp_result["ceiling"]["bytes_per_s"] or 0
    head = "decodepack: ceiling %.3f TB/s on %s" % (ceil / 1e12, dp_result.get("device", "?"))
    if base_result:
        head += "; baseline (%s): ceiling %.3f TB/s" % (base_result.get("implementation", "?"),
                                                       (base_result["ceiling"]["bytes_per_s"] or 0) / 1e12)
    lines.append(head)
    cols = ["class", "width", "dp us", "dp share"] + (["base us", "base share", "speedup"] if base else [])
    lines.append("%-14s %5s %10s %9s" % tuple(cols[:4]) + ("" if not base else " %10s %10s %8s" % tuple(cols[4:])))
    for c in classes:
        for w in widths:
            d = dp.get((c, w))
            b = base.get((c, w)) if base else None
            if d is None and b is None:
                continue
            dus, dsh = (d[0], d[1]) if d else (None, None)
            row = "%-14s %5d %10s %9s" % (c, w, fmt_us(dus), fmt_share(dsh))
            if base:
                bus, bsh = (b[0], b[1]) if b else (None, None)
                sp = "%.2fx" % (bus / dus) if dus and bus else "-"
                row += " %10s %10s %8s" % (fmt_us(bus), fmt_share(bsh), sp)
            notes = [("decodepack " + d[2]) for d in [d] if d and d[2] != "ok"]
            notes += [("baseline " + b[2]) for b in [b] if b and b[2] != "ok"]
            if notes:
                row += "  (" + ", ".join(notes) + ")"
            lines.append(row)
    return "\n".join(lines)


def draw(out, dp_result, base_result=None, title=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dp, base = figures(dp_result), figures(base_result) if base_result else None
    classes, widths = columns(dp, base)
    fig, axes = plt.subplots(2, len(classes), figsize=(3.6 * len(classes), 6.4), squeeze=False)
    bar = 0.38 if base else 0.6
    xs = list(range(len(widths)))
    for j, c in enumerate(classes):
        top, bottom = axes[0][j], axes[1][j]
        for k, (name, figs, hatch) in enumerate([("decodepack", dp, None), ("baseline", base, "//")]):
            if figs is None:
                continue
            off = (k - 0.5) * bar if base else 0
            share = [(figs.get((c, w)) or (None, None))[1] for w in widths]
            us = [(figs.get((c, w)) or (None, None))[0] for w in widths]
            top.bar([x + off for x in xs], [100 * v if v is not None else 0 for v in share], bar, hatch=hatch,
                    label=name, color="C0" if k == 0 else "C1", edgecolor="black", linewidth=0.4)
            bottom.bar([x + off for x in xs], [v if v is not None else 0 for v in us], bar, hatch=hatch, label=name,
                       color="C0" if k == 0 else "C1", edgecolor="black", linewidth=0.4)
        if base:
            for x, w in zip(xs, widths):
                d, b = dp.get((c, w)), base.get((c, w))
                if d and b and d[0] and b[0]:
                    h = max(d[0], b[0])
                    bottom.annotate("%.2fx" % (b[0] / d[0]), (x, h), ha="center", va="bottom", fontsize=8)
        top.set_title(c, fontsize=10)
        top.set_ylim(0, 100)
        top.axhline(100, color="gray", linewidth=0.5)
        for ax in (top, bottom):
            ax.set_xticks(xs)
            ax.set_xticklabels([str(w) for w in widths])
            ax.set_xlabel("batch width")
        if j == 0:
            top.set_ylabel("share of the HBM read ceiling (%)")
            bottom.set_ylabel("µs per layer (per step: whole step)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    ceil = dp_result["ceiling"]["bytes_per_s"] or 0
    sub = "%s, ceiling %.2f TB/s, context %s" % (dp_result.get("device", "?"), ceil / 1e12, dp_result.get("context"))
    fig.suptitle((title + "\n" if title else "") + sub, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="the PNG to write (not with --table)")
    ap.add_argument("bench", help="decodepack bench --json output")
    ap.add_argument("--baseline", help="bench/baseline.py --json output")
    ap.add_argument("--table", action="store_true", help="print a table instead of drawing")
    ap.add_argument("--title")
    a = ap.parse_args(argv)
    dp = load(a.bench)
    base = load(a.baseline) if a.baseline else None
    if a.table:
        if a.out:
            ap.error("--table takes the bench JSON only (and --baseline), no PNG")
        print(table(dp, base))
        return 0
    if not a.out:
        ap.error("give the PNG to write, or --table")
    draw(a.out, dp, base, a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
