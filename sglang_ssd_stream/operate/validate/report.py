"""JSON + Markdown report, and a plot of prompt length vs latency (and KV use where exposed)."""

from __future__ import annotations

import json
from pathlib import Path


def _points(results: dict) -> list[tuple]:
    return [(c["prompt_tokens"], c["latency_s"], (c.get("kv") or {}).get("used_tokens"))
            for c in results.get("suites", {}).get("needle", {}).get("checks", [])
            if c.get("prompt_tokens") and c.get("latency_s") is not None]


def text_chart(points: list[tuple], width: int = 50) -> str:
    """The latency curve as text (one bar per prompt length), for runtimes without matplotlib."""
    top = max(p[1] for p in points) or 1.0
    lines = ["prompt tokens | latency", "---:|:---"]
    for tokens, latency, kv in sorted(points):
        bar = "#" * max(1, round(width * latency / top))
        lines.append(f"{tokens:>13,} | {bar} {latency:.2f} s" + (f" (KV {kv:,} tokens)" if kv is not None else ""))
    return "\n".join(lines) + "\n"


def write_plot(results: dict, path: Path) -> str:
    """Returns what happened, for the report: 'written', 'text chart …', or why not."""
    points = _points(results)
    if not points:
        return "not written: no needle measurements"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the engines' runtimes do not ship it: the same curve as text
        text = path.with_suffix(".txt")
        text.write_text(text_chart(points))
        return f"text chart {text} (matplotlib is not installed; `pip install matplotlib` for a PNG)"
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p[0] for p in points]
    ax.plot(xs, [p[1] for p in points], "o-", label="latency (s)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("latency (s)")
    kv = [(p[0], p[2]) for p in points if p[2] is not None]
    if kv:
        ax2 = ax.twinx()
        ax2.plot([k[0] for k in kv], [k[1] for k in kv], "s--", color="tab:orange", label="KV tokens in use")
        ax2.set_ylabel("KV tokens in use")
    ax.set_title("needle recall: prompt length vs latency")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "written"


def check_line(c: dict) -> str:
    """One check or soak stage as ``label: status (its fields)``, from the fields it really has."""
    if c.get("check"):
        label = c["check"]
    elif "stage" in c:
        label = f"session {c.get('session')} cycle {c.get('cycle')} {c['stage']}"
    else:
        label = "check"
    if c.get("detail"):
        detail = c["detail"]
    else:
        parts = [f"{k}={c[k]}" for k in ("prompt_tokens", "completion_tokens", "finish_reason") if c.get(k) is not None]
        if c.get("latency_s") is not None:
            parts.append(f"{c['latency_s']:.2f} s")
        if c.get("error"):
            parts.append(f"error: {c['error']}")
        if c.get("canary"):
            parts.append("canary: " + "; ".join(c["canary"]))
        detail = ", ".join(parts) or "no details"
    return f"{label}: {c['status']} ({detail})"


def markdown(results: dict) -> str:
    lines = [f"# Validation of {results['model']} at {results['url']}", "",
             f"Overall: **{results['status']}**", ""]
    if results.get("aborted"):
        lines += [f"Aborted: {results['aborted']}", ""]
    cal = results.get("calibration") or {}
    if cal:
        lines += [f"Calibration: {cal.get('chars_per_token', 0):.2f} characters/token, "
                  f"{cal.get('template_tokens')} template tokens", ""]
    lines += ["| suite | status | detail |", "|---|---|---|"]
    for name, r in results["suites"].items():
        checks = r.get("checks", [])
        passed = sum(1 for c in checks if c.get("status") == "pass")
        lines.append(f"| {name} | {r['status']} | {passed}/{len(checks)} checks passed |")
    needle = results["suites"].get("needle")
    if needle:
        lines += ["", "## Needle recall", "", "| target | prompt tokens | latency s | recalled | status |",
                  "|---|---|---|---|---|"]
        for c in needle["checks"]:
            lat = f"{c['latency_s']:.2f}" if c.get("latency_s") is not None else "-"
            lines.append(f"| {c['target_tokens']} | {c['prompt_tokens']} | {lat} | "
                         f"{sum(c['recalled'])}/{len(c['recalled'])} | {c['status']} |")
    for name in ("truncation", "soak"):
        r = results["suites"].get(name)
        if r:
            lines += ["", f"## {name.capitalize()}", ""]
            if name == "soak" and "per_session_tokens" in r:
                lines += [f"Budgets: {r['per_session_tokens']} prompt, {r.get('continue_tokens')} continue, "
                          f"{r.get('compact_tokens')} compress tokens per session; "
                          f"{r.get('completed', 0)}/{r.get('planned', 0)} stages completed", ""]
            for c in r["checks"]:
                lines.append(f"- {check_line(c)}")
    m = results["suites"].get("matrix")
    if m:
        lines += ["", "## Reasoning x tools", "",
                  "| thinking | tools | history | turns | tool turns | status | problems |",
                  "|---|---|---|---|---|---|---|"]
        for c in m["checks"]:
            lines.append(f"| {c['thinking']} | {c['tools']} | {c['history_reasoning']} | {c['turns']} | "
                         f"{c['tool_call_turns']} | {c['status']} | {'; '.join(c['problems'])[:200]} |")
    c = results["suites"].get("canary")
    if c:
        lines += ["", "## Canary", ""]
        for x in c["checks"]:
            lines.append(f"- {x['prompt'][:40]}…: {x['status']} "
                         f"{'; '.join(x.get('problems') or []) or x.get('error') or ''}")
    lines += ["", f"Plot: {results.get('plot')}", ""]
    points = _points(results)
    if points:
        lines += ["```", text_chart(points).rstrip(), "```", ""]
    return "\n".join(lines)


def write(results: dict, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results["plot"] = write_plot(results, out / "latency.png")
    (out / "report.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(results))
    return {"json": str(out / "report.json"), "markdown": str(out / "report.md"),
            "plot": str(out / "latency.png") if results["plot"] == "written" else None}
