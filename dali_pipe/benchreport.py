"""The benchmark's report in words and in a picture: the verdict on each ratio (a headline only when every round
agrees, else "no clear winner" with the range), the flags that make its figures suspect, the tables it prints,
and benchmark.png, which shows every number to 2 significant digits with its spread, the headline and every flag
of the text.

The rounds agree on a ratio when there are at least 2 of them, every round's ratio lies on the same side of 1,
and the largest is within AGREE_SPREAD of the smallest, and no measurement of the run was flagged (busy cores, a
loader faster than the synthetic ceiling). Otherwise the ratio is no headline: "no clear winner", with the range.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

from .prescribe import SHARE_WORDS, SHARES, budget_line, busy_cores
from .workdir import atomic

AGREE_SPREAD = 1.25  # the rounds agree when max / min of a ratio is at most this (and all lie on one side of 1)
FASTER_THAN_CEILING = 1.1  # dali over synthetic above this: the synthetic (ceiling) run was disturbed

LOADER_WORDS = {"dali": "dali", "packed": "the packed loader", "baseline": "the classic DataLoader",
                "synthetic": "synthetic data"}


def sig(v: float, digits: int = 2) -> str:
    """v to `digits` significant digits, never in exponent form: 2123 -> '2100', 1.53 -> '1.5', 0.853 -> '0.85'."""
    if v is None or not math.isfinite(v):
        return "-"
    if v == 0:
        return "0"
    d = digits - 1 - math.floor(math.log10(abs(v)))
    return f"{round(v, d):.{max(d, 0)}f}"


def disagreement(r: dict) -> str | None:
    """Why the rounds of a ratio (a `spread`) do not agree, or None when they do."""
    rounds = r.get("rounds") or [r["median"]]
    if len(rounds) < 2:
        return "one round shows no spread; --repeat 2 or more to tell"
    if min(rounds) <= 1 <= max(rounds):
        return "the rounds fall on both sides of 1"
    if max(rounds) > AGREE_SPREAD * min(rounds):
        return f"the rounds differ by more than {AGREE_SPREAD - 1:.0%}"
    return None


def _ratio_words(r: dict) -> str:
    return f"{sig(r['median'])}x ({sig(r['min'])}-{sig(r['max'])})"


def verdict_line(a: str, b: str, r: dict, *, cores: int, disturbed: bool, after: str = "") -> str:
    """The headline on a ratio a/b (every round agreeing, nothing flagged), else 'no clear winner' with the range."""
    n = len(r.get("rounds") or [r["median"]])
    why = "the run was flagged: see the warnings" if disturbed else disagreement(r)
    if why is None:
        return (f"{a} delivers {_ratio_words(r)} the images/s of {LOADER_WORDS[b]} on {cores} core(s), every one "
                f"of {n} rounds agreeing{after}.")
    return (f"no clear winner between {LOADER_WORDS[a]} and {LOADER_WORDS[b]} on {cores} core(s): {a}/{b} was "
            f"{sig(r['min'])}-{sig(r['max'])}x over {n} round(s) ({why}).")


def faster_than_ceiling(ratio: dict) -> str | None:
    """The flag when dali measured faster than the synthetic ceiling (which a real loader cannot be), or None."""
    r = ratio.get("dali_vs_synthetic")
    if r is None or r["median"] <= FASTER_THAN_CEILING:
        return None
    return (f"dali measured {sig(r['median'])}x faster than the synthetic-data ceiling, which a real loader cannot be: "
            "the synthetic run was disturbed (other processes on the cores, or too few --warmup steps for the model "
            "to settle); rerun on idle cores, or with more --warmup and --steps.")


def flags(loaders: dict, ratio: dict, *, cores: int, model: bool) -> list[str]:
    """What makes the run's figures suspect, each in words with its fix: other processes on the pinned cores in
    any round, a loader faster than the synthetic ceiling."""
    out = []
    for name, m in loaders.items():
        worst = max((x for x in m.get("other_load_cores_rounds") or [m.get("other_load_cores")] if x is not None),
                    default=None)
        busy = busy_cores(name, {"other_load_cores": worst}, cores) if worst is not None else None
        if busy:
            out.append(busy)
    fast = faster_than_ceiling(ratio) if model else None
    if fast:
        out.append(fast)
    return out


def ratio_lines(ratio: dict, *, cores: int, model: bool, packed: str | None = None, data: str | None = None,
                disturbed: bool = False) -> list[str]:
    """Each ratio in words: dali against the classic DataLoader and the pack against --data as a headline or 'no
    clear winner' (`disturbed`: the run was flagged), dali against the synthetic ceiling as a share (or its flag)."""
    lines = []
    if "dali_vs_baseline" in ratio:
        lines.append(verdict_line("dali", "baseline", ratio["dali_vs_baseline"], cores=cores, disturbed=disturbed))
    if "dali_vs_synthetic" in ratio and model:
        r = ratio["dali_vs_synthetic"]
        fast = faster_than_ceiling(ratio)
        lines.append(fast or f"dali reaches {r['median']:.0%} ({r['min'] * 100:.0f}-{r['max']:.0%}) of the "
                             "synthetic-data ceiling.")
    if "packed_vs_dali" in ratio:
        r = ratio["packed_vs_dali"]
        after = (f" ({packed} against {data}); the other way round, --data reaches {sig(1 / r['median'])}x "
                 f"({sig(1 / r['max'])}-{sig(1 / r['min'])}) of the pack")
        lines.append(verdict_line("packed", "dali", r, cores=cores, disturbed=disturbed, after=after))
    return lines


def headlines(report: dict) -> list[str]:
    """The report's verdict lines on its ratios (headline or no clear winner), as printed."""
    return [d for d in report.get("diagnosis", []) if d.startswith(("no clear winner", "dali delivers", "packed delivers"))]


# -- printing -------------------------------------------------------------------------------------
def _fmt(k, v):
    if v is None:
        return "-"
    if k in ("data_wait_fraction",) or k.startswith("time_"):
        return f"{v:.0%}" if k.startswith("time_") else f"{v:.1%}"
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _grid(rows: list[list[str]]) -> list[str]:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, width)) for r in rows]


SHORT = {"startup": "start-up", "data_wait": "data", "model_step": "model", "checkpoint_saves": "saves",
         "validation": "val", "callbacks": "other"}


def round_table(r: int, repeat: int, metrics: dict[str, dict]) -> str:
    """The loaders of one round: images/s, step times, data wait, utilization, peak memory and their time budget."""
    head = ["loader", "img/s", "p50 ms", "p95 ms", "wait", "cpu %", "gpu %", "rss MB"] + [SHORT[k] for k in SHARES]
    rows = [head]
    for n, m in metrics.items():
        shares = (m.get("time_budget") or {}).get("shares", {})
        rows.append([n] + [_fmt(k, m.get(k)) for k in ("images_per_sec", "step_ms_p50", "step_ms_p95",
                                                        "data_wait_fraction", "cpu_util_mean", "gpu_util_mean",
                                                        "rss_peak_mb")]
                    + [_fmt("time_" + k, shares.get(k)) for k in SHARES])
    words = ", ".join(f"{SHORT[k]} = {SHARE_WORDS[k]}" for k in SHARES if SHORT[k] != SHARE_WORDS[k])
    return "\n".join([f"round {r}/{repeat} (then each loader's time budget: {words}):"] + _grid(rows)) + "\n"


def table(report: dict) -> str:
    cols = ["images_per_sec", "step_ms_p50", "step_ms_p95", "data_wait_fraction", "cpu_util_mean",
            "gpu_util_mean", "gpu_util_p5", "gpu_mem_peak_mb", "rss_peak_mb"]
    head = ["loader", "img/s", "min-max", "p50 ms", "p95 ms", "wait", "cpu %", "gpu %", "gpu p5", "gpu MB", "rss MB"]
    rows = [head]
    for n, m in report["loaders"].items():
        r = m["images_per_sec_rounds"]
        rows.append([n, _fmt("", r["median"]), f"{sig(r['min'])}-{sig(r['max'])}"]
                    + [_fmt(k, m.get(k)) for k in cols[1:]])
    n = report["config"]["repeat"]
    lines = [f"summary over {n} round(s):"] + _grid(rows)
    lines += ["rss MB: the peak memory of the process tree in any round, start-up included (this process's peak "
              "RSS plus its workers' own memory: the pages they share with it counted once)"]
    lines += [f"ratio {k}: {v['median']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f} over {n} round(s))"
              for k, v in report["ratios"].items()]
    lines += [f"{name} {budget_line(m['time_budget'])}" for name, m in report["loaders"].items()
              if m.get("time_budget")]
    lines += [f"- {d}" for d in report["diagnosis"]]
    lines += [f"warning: {w}" for w in report.get("flags", [])]
    return "\n".join(lines)


# -- the picture ----------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    """benchmark.png: the figure of the report, written whole or not at all."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    try:
        with atomic(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def _wrap(text: str, width: int = 190) -> str:
    return "\n".join(textwrap.wrap(text, width))


def figure(report: dict):
    """The report drawn: the timeline (GPU utilization, or the time per step), the throughput with its spread,
    each loader's time budget, then the verdict on the ratios and every flag of the text (in red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(report["loaders"])
    gpu = report["env"]["gpu"] is not None
    alone = report["config"]["model"] == "none"  # no model: every millisecond of a step is the loader's
    words = headlines(report) + report.get("notes", [])
    warnings = report.get("flags")
    if warnings is None:  # a report written before its flags were kept: the same, from its loaders and ratios
        warnings = flags(report["loaders"], report["ratios"], cores=report["env"]["cpus"], model=not alone)
    lines = [(_wrap(w), "black") for w in words] + [(_wrap("warning: " + w), "#c9302c") for w in warnings]
    text_rows = sum(t.count("\n") + 1 for t, _ in lines)
    height = 4.6 + 0.22 * text_rows
    fig = plt.figure(figsize=(17, height))
    bottom = (0.22 * text_rows + 0.25) / height  # the text's share of the figure, under the panels
    grid = fig.add_gridspec(1, 3, width_ratios=[2, 1, 1.2], left=0.05, right=0.98, top=1 - 0.55 / height,
                            bottom=bottom + 1.05 / height, wspace=0.28)
    ax1, ax2, ax3 = (fig.add_subplot(grid[0, i]) for i in range(3))
    for n in names:
        tl = report["timelines"][n]
        m = report["loaders"][n]
        if gpu and tl["gpu"]:
            t, u = zip(*tl["gpu"])
            ax1.plot(t, u, label=f"{n} (mean {sig(m['gpu_util_mean'])}%)", lw=1.4)
        else:
            wait = "" if alone or m.get("data_wait_fraction") is None else \
                f" (wait {sig(100 * m['data_wait_fraction'])}%)"
            ax1.plot(range(1, len(tl["wait_ms"]) + 1), tl["wait_ms"], label=n + wait, lw=1.4)
    if gpu:
        ax1.set(xlabel="seconds into the timed window", ylabel="GPU utilization %", ylim=(0, 105),
                title="GPU utilization over time (NVML, 20 Hz)")
    elif alone:
        ax1.set(xlabel="timed step", ylabel="ms per batch", title="Time per batch, loaders alone (no model, no GPU)")
    else:
        ax1.set(xlabel="timed step", ylabel="ms blocked waiting for the batch", title="Data-wait per step (no GPU)")
    if not gpu:
        ax1.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 or 7.5 on the axis
    ax1.legend(loc="best", fontsize=9, framealpha=0.85)
    ax1.grid(alpha=0.3)
    rounds = [report["loaders"][n]["images_per_sec_rounds"] for n in names]
    med = [r["median"] for r in rounds]
    err = [[r["median"] - r["min"] for r in rounds], [r["max"] - r["median"] for r in rounds]]
    colors = [{"dali": "#76b900", "packed": "#3d6b00", "baseline": "#888888"}.get(n, "#4a90d9") for n in names]
    bars = ax2.bar(names, med, yerr=err, capsize=4, color=colors)
    top = max(r["max"] for r in rounds)
    ax2.set_ylim(0, 1.3 * top)  # room for the labels over the bars
    for b, r in zip(bars, rounds):
        ax2.annotate(f"{sig(r['median'])}\n({sig(r['min'])}-{sig(r['max'])})", (b.get_x() + b.get_width() / 2, r["max"]),
                     ha="center", va="bottom", xytext=(0, 3), textcoords="offset points", fontsize=9)
    n_rounds = report["config"]["repeat"]
    ax2.set(ylabel="images / s", title=f"Throughput: median (min-max) of {n_rounds} round(s)")
    ax2.grid(axis="y", alpha=0.3)
    budget_panel(ax3, {n: report["loaders"][n].get("time_budget") for n in names})
    cfg = report["config"]
    fig.suptitle(f"model {cfg['model']}, batch {cfg['batch_size']}, {report['env']['cpus']} CPU core(s), "
                 f"{report['env']['gpu'] or 'no GPU'}, {cfg['repeat']} round(s)", fontsize=11)
    y = bottom - 0.1 / height
    for text, color in lines:  # a figure seen without its log says what the log says of its figures
        fig.text(0.01, y, text, color=color, fontsize=10, va="top")
        y -= 0.22 * (text.count("\n") + 1) / height
    return fig


BUDGET_COLORS = {"startup": "#b0b0b0", "data_wait": "#d9534f", "model_step": "#76b900", "checkpoint_saves": "#f0ad4e",
                 "validation": "#4a90d9", "callbacks": "#9b59b6"}


def budget_panel(ax, budgets: dict[str, dict | None]) -> None:
    """One stacked bar per loader: where its run's wall time went, in the budget's six shares; the legend under
    the axis label, clear of it."""
    names = [n for n, b in budgets.items() if b]
    left = [0.0] * len(names)
    for k in SHARES:
        widths = [100 * budgets[n]["shares"][k] for n in names]
        ax.barh(names, widths, left=left, color=BUDGET_COLORS[k], label=SHARE_WORDS[k])
        for i, w in enumerate(widths):
            if w >= 8:
                ax.text(left[i] + w / 2, i, f"{sig(w)}%", ha="center", va="center", fontsize=8)
        left = [a + w for a, w in zip(left, widths)]
    ax.set(xlim=(0, 100), xlabel="% of the loader's run (wall time)", title="Where the time goes")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)

