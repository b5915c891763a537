"""Issue 42: the kit's ``ssd_stream_*`` series in the real vLLM server's ``/metrics`` (no start of its own: the MTP
scenario runs with ``PROMETHEUS_MULTIPROC_DIR`` set and scrapes after its traffic).

vLLM serves ``/metrics`` from its API server process; the PLE lookups run in the worker. With the variable set
(an empty directory, before ``vllm serve`` starts) both run prometheus_client in multiprocess mode and the API
server's registry merges the worker's files. The values must be the row caches' own: per layer, hits + misses =
lookups, bytes read = pages x 4,096, rows fetched on demand + ahead = rows read; and no fewer lookups than the
worker's own activity line counted before; vLLM's own series are still there.
"""

from __future__ import annotations

import functools
import re

import pytest

from sglang_ssd_stream.ple_metrics import series as S

from ..ple_metrics.prometheus_server import skip_or_fail
from ..ple_metrics.scrape import by_layer
from ..ple_metrics.scrape import samples as _samples

_by_layer = functools.partial(by_layer, engine="vllm")  # every series of this server is vllm's, of rank 0


def test_the_kits_series_are_in_vllms_metrics_and_agree_with_the_row_caches(streamed_mmap_mtp):
    sc = streamed_mmap_mtp
    samples = _samples(sc.results["metrics"])
    assert any(n.startswith("vllm:") for n, _ in samples)  # vLLM's own series, in the same scrape
    bound = {m for line in sc.grep(r"PLE \S*layers\.\d+\.\S*: sidecar ")
             for m in re.findall(r"layers\.(\d+)\.\S*: sidecar ", line)}
    lookups = _by_layer(samples, S.LOOKUPS.sample)
    assert bound and set(lookups) == bound, (bound, lookups)  # one series per streamed PLE layer of the worker
    hits, misses = _by_layer(samples, S.HITS.sample), _by_layer(samples, S.MISSES.sample)
    pages, nbytes = _by_layer(samples, S.PAGES_READ.sample), _by_layer(samples, S.BYTES_READ.sample)
    read, ahead = _by_layer(samples, S.ROWS_READ.sample), _by_layer(samples, S.AHEAD.sample)
    demand, exposed = _by_layer(samples, S.ON_DEMAND.sample), _by_layer(samples, S.EXPOSED_SECONDS.sample)
    for layer in bound:
        assert hits[layer] + misses[layer] == lookups[layer] > 0, layer
        assert nbytes[layer] == pages[layer] * 4096 > 0, layer
        assert demand[layer] + ahead[layer] == read[layer] and ahead[layer] > 0, layer  # the prompt-ahead fetch
        assert exposed[layer] > 0, layer  # eager lookups observed
    logged = [int(m) for line in sc.grep(r"PLE prompt-ahead prefetch: \d+ chunk") for m in
              re.findall(r"of (\d+) lookups hit", line)]
    assert logged and sum(lookups.values()) >= max(logged), (logged, lookups)  # the log's last count, or more
    refused = {dict(lab)["reason"]: v for (n, lab), v in samples.items() if n == S.REFUSALS.sample}
    assert set(refused) == set(S.REASONS) and not any(refused.values()), refused  # every reason shown, none met


def test_a_real_prometheus_scrapes_the_server_and_answers_the_hit_rate(streamed_mmap_mtp):
    """Debian's prometheus, started on loopback for the scenario, scraped vLLM's /metrics every second; after the
    traffic it answers the lookups, the bytes read and the hit-rate query as the row caches count them."""
    got = streamed_mmap_mtp.results["prometheus"]
    if "skipped" in got:
        skip_or_fail(got["skipped"])
    assert "error" not in got, got
    samples = _samples(streamed_mmap_mtp.results["metrics"])
    hits, lookups, nbytes = (sum(_by_layer(samples, s.sample).values()) for s in (S.HITS, S.LOOKUPS, S.BYTES_READ))
    assert got["lookups"] == lookups > 0 and got["bytes_read"] == nbytes > 0, got
    assert got["hit_rate"] == pytest.approx(hits / lookups, rel=1e-12) and 0 < got["hit_rate"] <= 1, got
