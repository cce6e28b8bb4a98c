"""PNG plots of a load-test result (the JSON written by loadtest.run): latency CDFs per arm
(TTFT, TPOT, ITL, end-to-end) and throughput / TPOT against the offered load. matplotlib is
optional: `available()` says whether it is installed, and nothing else imports it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

METRICS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL (per chunk)"), ("e2els", "end-to-end latency"))
COLORS = {"spec": "tab:blue", "nospec": "tab:orange"}  # colour = arm, line style = load level
STYLES = ("-", "--", ":", "-.")


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _values_ms(arm: dict, key: str) -> list[float]:
    vals = arm.get(key) or []
    flat = [x for v in vals for x in (v if isinstance(v, list) else [v])]
    return sorted(1000.0 * x for x in flat if x is not None)


def load_label(level: dict) -> str:
    rate = level["request_rate"]
    if rate == "inf":
        return f"concurrency {level['max_concurrency']}"
    return f"{rate} req/s" + (f" (max {level['max_concurrency']})" if level.get("max_concurrency") else "")


def plot_cdfs(result: dict, path: str | Path) -> Path:
    """One panel per latency metric; one line per arm and load level."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.6))
    for ax, (key, title) in zip(axes, METRICS):
        for level, run in enumerate(result["runs"]):
            for arm, res in run["arms"].items():
                xs = _values_ms(res, key)
                if not xs:
                    continue
                xs = [xs[0], *xs]
                ys = [0.0] + [(i + 1) / (len(xs) - 1) for i in range(len(xs) - 1)]
                label = arm if len(result["runs"]) == 1 else f"{arm}, {load_label(run['level'])}"
                ax.step(xs, ys, where="post", label=label, color=COLORS.get(arm),
                        linestyle=STYLES[level % len(STYLES)])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"specmesh load test ({result['backend']}): latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_throughput(result: dict, path: str | Path) -> Path:
    """Against the load levels of the run: output tokens/s of the whole run (all arms: in an A/B run
    the arms share the machine, so per-arm throughput is only a share), and each arm's TPOT."""
    plt = _pyplot()
    runs = result["runs"]
    labels = [load_label(r["level"]) for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    total = [r["output_throughput"] for r in runs]
    a1.plot(labels, total, marker="o", color="black", label="all requests")
    for arm in sorted({a for r in runs for a in r["arms"]}):
        mean = [r["arms"].get(arm, {}).get("mean_tpot_ms") for r in runs]
        p90 = [r["arms"].get(arm, {}).get("p90_tpot_ms") for r in runs]
        a2.plot(labels, mean, marker="o", label=f"{arm} mean", color=COLORS.get(arm))
        if any(v is not None for v in p90):
            a2.plot(labels, p90, marker=".", linestyle="--", label=f"{arm} p90", color=COLORS.get(arm))
    a1.set_title("output throughput (tokens/s)")
    a2.set_title("TPOT (ms)")
    a1.set_ylim(bottom=0)
    a2.set_ylim(bottom=0)
    for ax in (a1, a2):
        ax.set_xlabel("offered load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"specmesh load test ({result['backend']}): throughput vs load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_plots(result: dict, json_path: str | Path) -> list[Path]:
    """`<stem>-cdf.png` and `<stem>-throughput.png` next to the JSON."""
    p = Path(json_path)
    return [plot_cdfs(result, p.with_name(p.stem + "-cdf.png")),
            plot_throughput(result, p.with_name(p.stem + "-throughput.png"))]
