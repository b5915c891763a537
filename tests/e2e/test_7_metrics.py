"""Issue 42: the kit's ``ssd_stream_*`` series in the real sglang server's ``/metrics`` (no start of its own: the
MTP sidecar scenario runs the Thor profile's ``--enable-metrics`` and scrapes after its traffic).

sglang's launcher sets ``PROMETHEUS_MULTIPROC_DIR`` for ``--enable-metrics``; the scheduler, where the PLE row
caches live, publishes into it and the HTTP server's ``/metrics`` merges it. The values must be the row caches'
own: per layer, hits + misses = lookups, bytes read = pages x 4,096, rows fetched on demand + ahead = rows read;
and no fewer lookups than the scheduler's own log line counted before.
"""

from __future__ import annotations

import functools
import re

import pytest

from sglang_ssd_stream.ple_metrics import series as S

from ..ple_metrics.prometheus_server import skip_or_fail
from ..ple_metrics.scrape import by_layer
from ..ple_metrics.scrape import samples as _samples

_by_layer = functools.partial(by_layer, engine="sglang")  # every series of this server is sglang's, of rank 0


def _lines(sc, pattern: str) -> list[str]:
    return [line for line in sc.log.splitlines() if re.search(pattern, line)]


def test_the_kits_series_are_in_sglangs_metrics_and_agree_with_the_row_caches(qwen4_mtp_sidecar):
    sc = qwen4_mtp_sidecar
    samples = _samples(sc.results["metrics"])
    assert any(n.startswith("sglang:") for n, _ in samples)  # sglang's own series, in the same scrape
    bound = {m for line in _lines(sc, r"PLE layer \d+: sidecar ") for m in re.findall(r"PLE layer (\d+):", line)}
    lookups = _by_layer(samples, S.LOOKUPS.sample)
    assert bound and set(lookups) == bound, (bound, lookups)  # one series per PLE layer of the scheduler
    hits, misses = _by_layer(samples, S.HITS.sample), _by_layer(samples, S.MISSES.sample)
    pages, nbytes = _by_layer(samples, S.PAGES_READ.sample), _by_layer(samples, S.BYTES_READ.sample)
    read, ahead = _by_layer(samples, S.ROWS_READ.sample), _by_layer(samples, S.AHEAD.sample)
    demand, exposed = _by_layer(samples, S.ON_DEMAND.sample), _by_layer(samples, S.EXPOSED_SECONDS.sample)
    for layer in bound:
        assert hits[layer] + misses[layer] == lookups[layer] > 0, layer
        assert nbytes[layer] == pages[layer] * 4096 > 0, layer
        assert demand[layer] + ahead[layer] == read[layer] and ahead[layer] > 0, layer  # the prompt-ahead fetch
        assert exposed[layer] > 0, layer  # eager lookups observed (a CPU server runs no graph)
    logged = [int(m) for line in _lines(sc, r"PLE prompt-ahead prefetch: ")
              for m in re.findall(r"of (\d+) lookups hit", line)]
    assert logged and sum(lookups.values()) >= max(logged), (logged, lookups)  # the log's last count, or more
    refused = {dict(lab)["reason"]: v for (n, lab), v in samples.items() if n == S.REFUSALS.sample}
    assert set(refused) == set(S.REASONS) and not any(refused.values()), refused  # every reason shown, none met


def test_a_real_prometheus_scrapes_the_server_and_answers_the_hit_rate(qwen4_mtp_sidecar):
    """Debian's prometheus, started on loopback for the scenario, scraped sglang's /metrics every second; after the
    traffic it answers the hit-rate query with the row caches' own ratio."""
    got = qwen4_mtp_sidecar.results["prometheus"]
    if "skipped" in got:
        skip_or_fail(got["skipped"])
    assert "error" not in got, got
    samples = _samples(qwen4_mtp_sidecar.results["metrics"])
    hits, lookups, nbytes = (sum(_by_layer(samples, s.sample).values()) for s in (S.HITS, S.LOOKUPS, S.BYTES_READ))
    assert got["lookups"] == lookups > 0 and got["bytes_read"] == nbytes > 0, got
    # the prefetch fetches every row of this scenario ahead (test_5): the rate is 1, and Prometheus says so
    assert got["hit_rate"] == pytest.approx(hits / lookups, rel=1e-12) and 0 < got["hit_rate"] <= 1, got
