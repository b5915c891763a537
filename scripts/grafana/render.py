#!/usr/bin/env python3
"""Draw the Grafana dashboard's panels into one PNG from its own PromQL, run against a real Prometheus.

Not Grafana (it has no Debian package and the development box reaches no other source): every panel's queries are
sent, as the dashboard has them, to Prometheus's HTTP API (``/api/v1/query_range``) over a time range, with the
dashboard's variables and Grafana's built-in ones substituted as Grafana does (``$__rate_interval`` = max(step +
scrape interval, 4 x scrape interval); ``$__range``; ``$__interval`` = the step); each series is drawn with
matplotlib in the panel's place on the dashboard's 24-column grid, named by its ``legendFormat``. The picture says
it was drawn this way.

    render.py --prometheus http://127.0.0.1:9090 --start UNIX --end UNIX -o dashboard.png
    render.py --kept DIR -o dashboard.png   # what tests/ple_metrics/prometheus_server.py kept of a server's run
                                            # (SSD_STREAM_KEEP_PROMETHEUS=DIR): Debian's prometheus is started
                                            # on loopback over a copy of it, and the range is its traffic's

Needs matplotlib (the engine venvs have it). Exit status: 0 drawn, 1 a query or Prometheus failed, 64 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "scripts" / "grafana" / "ssd-stream-ple.json"
NOTE = "rendered from the dashboard's queries by scripts/grafana/render.py, not by Grafana"
GRID_COLUMNS = 24  # Grafana's grid
MARGIN_S = 10.0  # drawn before and after a kept run's traffic


class QueryFailed(RuntimeError):
    pass


def variables(dashboard: dict, given: dict[str, str]) -> dict[str, str]:
    """The dashboard's template variables as Grafana would fill them: ``given`` first, then each one's current
    value (``All`` of a custom variable: its ``allValue``). The data source variable is not substituted."""
    out = {}
    for v in dashboard.get("templating", {}).get("list", []):
        name = v["name"]
        if v.get("type") == "datasource":
            continue
        if name in given:
            out[name] = given[name]
            continue
        current = v.get("current", {}).get("value", v.get("query", ""))
        out[name] = v.get("allValue", ".*") if current == "$__all" else str(current)
    unknown = set(given) - set(out)
    if unknown:
        raise SystemExit(f"render.py: the dashboard has no variable {', '.join(sorted(unknown))}")
    return out


def substitute(expr: str, values: dict[str, str], *, step: float, scrape: float, span: float) -> str:
    builtins = {"__rate_interval": f"{int(max(step + scrape, 4 * scrape))}s", "__interval": f"{int(step)}s",
                "__range": f"{int(span)}s"}
    table = {**values, **builtins}

    def one(m):
        name = m.group(1) or m.group(2)
        if name not in table:
            raise QueryFailed(f"{expr!r}: no value for ${name}")
        return table[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{q}", timeout=30) as r:
            body = json.loads(r.read())
    except OSError as exc:
        raise QueryFailed(f"{expr!r}: {exc}") from exc
    if body.get("status") != "success":
        raise QueryFailed(f"{expr!r}: {body}")
    return body["data"]["result"]


def legend(fmt: str | None, metric: dict) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


UNITS = {"percentunit": ("%", 100.0), "ms": ("ms", 1.0), "MiBs": ("MiB/s", 1.0), "iops": ("IOPS", 1.0),
         "short": ("", 1.0)}


def style(panel: dict, name: str) -> dict:
    """The panel's by-name overrides that this drawing can honour: a fixed colour, a dashed line."""
    out = {}
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if o.get("matcher", {}).get("id") != "byName" or o["matcher"].get("options") != name:
            continue
        for prop in o.get("properties", []):
            if prop["id"] == "color" and prop["value"].get("mode") == "fixed":
                out["color"] = prop["value"]["fixedColor"]
            elif prop["id"] == "custom.lineStyle" and prop["value"].get("fill") == "dash":
                out["dashes"] = prop["value"].get("dash", [10, 10])
    return out


def panel_series(panel: dict, url: str, values: dict, start: float, end: float, step: float, scrape: float):
    """[(legend, [t], [v])] of every target of the panel; raises QueryFailed."""
    out = []
    for target in panel.get("targets", []):
        expr = substitute(target["expr"], values, step=step, scrape=scrape, span=end - start)
        for s in query_range(url, expr, start, end, step):
            pts = [(float(t), float(v)) for t, v in s["values"] if math.isfinite(float(v))]
            if pts:
                out.append((legend(target.get("legendFormat"), s["metric"]), [p[0] for p in pts],
                            [p[1] for p in pts]))
    return out


def render(dashboard: dict, url: str, start: float, end: float, *, step: float, scrape: float, values: dict,
           out: Path, source: str) -> dict:
    """Draws the PNG (written atomically); returns what each panel showed (series per panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p.get("type") == "timeseries"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_in = 0.3  # inches per grid row (Grafana's row is 30 px)
    height = rows * unit_in + 1.0
    fig = plt.figure(figsize=(16, height), dpi=72)
    top, bottom = 1 - 0.55 / height, 0.35 / height  # the title above, the source line below
    shown = {}
    for p in panels:  # each panel where the grid puts it, its title and ticks inside its cell
        g = p["gridPos"]
        cell_w, cell_h = 1 / GRID_COLUMNS, (top - bottom) / rows
        left = g["x"] * cell_w + 0.045
        ax = fig.add_axes((left, top - (g["y"] + g["h"]) * cell_h + 0.5 / height,
                           g["w"] * cell_w - 0.06, g["h"] * cell_h - 0.85 / height))
        ax.set_title(p["title"], fontsize=10, loc="left")
        unit, scale = UNITS.get(p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short"), ("", 1.0))
        series = panel_series(p, url, values, start, end, step, scrape)
        shown[p["title"]] = [name for name, _, _ in series]
        for name, ts, vs in series:
            ax.plot([mdates.date2num(_utc(t)) for t in ts], [v * scale for v in vs], label=name, linewidth=1.2,
                    **style(p, name))
        if not series:
            ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color="0.5")
        ax.set_xlim(mdates.date2num(_utc(start)), mdates.date2num(_utc(end)))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=_utc_tz()))
        ax.tick_params(labelsize=8)
        if unit:
            ax.set_ylabel(unit, fontsize=8)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7, loc="best", ncol=1 + len(series) // 6)
    fig.suptitle(f"{dashboard['title']}: {NOTE}", fontsize=12)
    fig.text(0.01, 0.005, f"{source}; {_utc(start):%Y-%m-%d %H:%M:%S} to {_utc(end):%H:%M:%S} UTC, step {step:g} s, "
             f"$__rate_interval {substitute('$__rate_interval', {}, step=step, scrape=scrape, span=0)}; variables "
             + ", ".join(f"{k}={v}" for k, v in values.items()), fontsize=8, color="0.35")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
    return shown


def _utc_tz():
    import datetime

    return datetime.timezone.utc


def _utc(t: float):
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc)


def _kept(kept: Path):
    """Debian's prometheus over a copy of a kept run's data (Prometheus writes to its data directory; the kept one
    stays as it was), and that run's range."""
    sys.path.insert(0, str(REPO))
    from tests.ple_metrics.prometheus_server import BINARY, MISSING, Prometheus

    if BINARY is None:
        raise QueryFailed(MISSING)
    run = json.loads((kept / "range.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="render-prometheus-"))
    shutil.copytree(kept / "data", work / "data")
    return Prometheus(None, work).wait_ready(), run, work


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prometheus", help="the Prometheus that scrapes the engine (its HTTP API's base URL)")
    src.add_argument("--kept", type=Path, help="a directory SSD_STREAM_KEEP_PROMETHEUS kept (data/, range.json)")
    ap.add_argument("--start", type=float, help="UNIX seconds (with --prometheus)")
    ap.add_argument("--end", type=float, help="UNIX seconds (with --prometheus)")
    ap.add_argument("--step", type=float, default=1.0, help="seconds between points (default 1)")
    ap.add_argument("--scrape-interval", type=float, help="Prometheus's scrape interval in seconds, for "
                    "$__rate_interval (default: 1 with --kept, as the tests scrape; else 15, Prometheus's default)")
    ap.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="a dashboard variable")
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.prometheus and (args.start is None or args.end is None):
        ap.error("--prometheus needs --start and --end")
    given = dict(v.split("=", 1) for v in args.var if "=" in v)
    if len(given) != len(args.var):
        ap.error("--var takes NAME=VALUE")
    dashboard = json.loads(args.dashboard.read_text())
    values = variables(dashboard, given)
    prom = work = None
    try:
        if args.kept:
            prom, run, work = _kept(args.kept)
            url, start, end = prom.url, run["start"] - MARGIN_S, run["end"] + MARGIN_S
            source = f"data: {args.kept.name}, Prometheus scraping {run['target']}/metrics every 1 s"
            scrape = args.scrape_interval or 1.0
        else:
            url, start, end, scrape = args.prometheus, args.start, args.end, args.scrape_interval or 15.0
            source = f"data: {args.prometheus}"
        shown = render(dashboard, url, start, end, step=args.step, scrape=scrape, values=values, out=args.out,
                       source=source)
    except QueryFailed as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 1
    finally:
        if prom is not None:
            prom.stop()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"out": str(args.out), "start": start, "end": end, "step": args.step, "panels": shown},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
