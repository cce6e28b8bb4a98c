"""The load-test result as a text table (vLLM's benchmark layout, one column per arm, plus the A/B
ratio), for the terminal and for README tables. Reads the result dict; computes nothing new."""

from __future__ import annotations

ROWS = (
    ("Successful requests", "completed", "{:.0f}"),
    ("Failed requests", "failed", "{:.0f}"),
    ("Total output tokens", "total_output_tokens", "{:.0f}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Request goodput (req/s)", "request_goodput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"),
    ("Median TTFT (ms)", "median_ttft_ms", "{:.1f}"),
    ("P99 TTFT (ms)", "p99_ttft_ms", "{:.1f}"),
    ("Mean TPOT (ms)", "mean_tpot_ms", "{:.1f}"),
    ("Median TPOT (ms)", "median_tpot_ms", "{:.1f}"),
    ("P99 TPOT (ms)", "p99_tpot_ms", "{:.1f}"),
    ("Mean ITL (ms, per chunk)", "mean_itl_ms", "{:.1f}"),
    ("P99 ITL (ms)", "p99_itl_ms", "{:.1f}"),
    ("Mean E2E latency (ms)", "mean_e2el_ms", "{:.1f}"),
    ("P90 E2E latency (ms)", "p90_e2el_ms", "{:.1f}"),
    ("Tokens per chunk", "mean_tokens_per_chunk", "{:.2f}"),
)
SPEC_ROWS = (
    ("Acceptance rate", "acceptance_rate", "{:.2f}"),
    ("Tokens per verify step", "tokens_per_step", "{:.2f}"),
    ("Predraft hit rate", "predraft_hit_rate", "{:.2f}"),
    ("Drafter timeouts", "drafter_timeouts", "{:.0f}"),
)
AB_ROWS = (
    ("TPOT speedup (nospec/spec)", "speedup_mean_tpot"),
    ("E2E speedup (nospec/spec)", "speedup_mean_e2el"),
    ("Throughput ratio (spec/nospec)", "output_throughput_ratio"),
)


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def table(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        arms = list(run["arms"])
        lv = run["level"]
        head = (f" {result['backend']} | concurrency {lv['max_concurrency'] or 'unbounded'} | "
                f"rate {lv['request_rate']} req/s | duration {run['duration']:.1f} s ")
        width = 34 + 14 * len(arms)
        lines += [head.center(width, "="), f"{'':<34}" + "".join(f"{a:>14}" for a in arms)]
        for label, key, fmt in ROWS:
            lines.append(f"{label:<34}" + "".join(f"{_fmt(fmt, run['arms'][a].get(key)):>14}" for a in arms))
        for label, key, fmt in SPEC_ROWS:
            lines.append(f"{label:<34}" + "".join(
                f"{_fmt(fmt, run['arms'][a]['speculation'].get(key)):>14}" for a in arms))
        ab = run.get("ab")
        if ab:
            for label, key in AB_ROWS:
                lines.append(f"{label:<34}{_fmt('{:.2f}', ab.get(key)):>14}")
            same = ab["identical_outputs"]
            if same["checked"]:
                lines.append(f"{'Identical outputs (greedy)':<34}{same['same']:>8} / {same['pairs']}")
        if run.get("not_sent"):
            lines.append(f"{'Requests not sent':<34}{run['not_sent']:>14}")
        if run.get("session_rebuilds"):
            lines.append(f"{'Sessions rebuilt (client side)':<34}{run['session_rebuilds']:>14}")
        lines.append("=" * width)
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The same numbers as a Markdown table (README)."""
    out = []
    for run in result["runs"]:
        arms = list(run["arms"])
        lv = run["level"]
        title = (f"{result['backend']}, concurrency {lv['max_concurrency'] or 'unbounded'}, "
                 f"rate {lv['request_rate']} req/s, {run['duration']:.0f} s")
        out += [title, "", "| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
        for label, key, fmt in ROWS:
            out.append(f"| {label} | " + " | ".join(_fmt(fmt, run["arms"][a].get(key)) for a in arms) + " |")
        for label, key, fmt in SPEC_ROWS:
            out.append(f"| {label} | " + " | ".join(_fmt(fmt, run["arms"][a]["speculation"].get(key))
                                                    for a in arms) + " |")
        ab = run.get("ab")
        if ab:
            pad = " |" * (len(arms) - 1)
            out += [f"| {label} | {_fmt('{:.2f}', ab.get(key))} |{pad}" for label, key in AB_ROWS]
            same = ab["identical_outputs"]
            if same["checked"]:
                out.append(f"| Identical outputs (greedy) | {same['same']} / {same['pairs']} |{pad}")
        out.append("")
    return "\n".join(out)
