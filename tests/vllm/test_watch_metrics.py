"""The names `watch` reads from vLLM (vllm_ple_offload/metrics.py) are the ones vLLM 0.33.0's own Prometheus
logger registers: its PrometheusStatLogger is built in this venv and its exposition parsed by `watch`."""

from __future__ import annotations

import dataclasses
import subprocess

from sglang_ssd_stream.operate.metrics import engine_sample, parse
from vllm_ple_offload.metrics import METRICS

EXPOSITION = r"""
import types
from unittest import mock
import prometheus_client
from vllm.v1.metrics.loggers import PrometheusStatLogger
cfg = mock.MagicMock()  # only what the logger reads to register its metrics is given real values
cfg.speculative_config = types.SimpleNamespace(num_speculative_tokens=2)
cfg.model_config.served_model_name = "m"
cfg.model_config.max_model_len = 262144
cfg.model_config.is_diffusion = False
cfg.observability_config.show_hidden_metrics = False
cfg.observability_config.kv_cache_metrics = False
cfg.observability_config.custom_histogram_buckets = None
cfg.kv_transfer_config = cfg.ec_transfer_config = cfg.lora_config = None
logger = PrometheusStatLogger(cfg, [0])
logger.gauge_kv_cache_usage[0].set(0.37)
logger.spec_decoding_prom.counter_spec_decode_num_drafts[0].inc(100)
logger.spec_decoding_prom.counter_spec_decode_num_draft_tokens[0].inc(200)
logger.spec_decoding_prom.counter_spec_decode_num_accepted_tokens[0].inc(86)
print(prometheus_client.generate_latest().decode())
"""


def test_vllm_exports_every_name_watch_reads(vllm):
    r = subprocess.run([vllm.python, "-c", EXPOSITION], capture_output=True, text=True, env=vllm.env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    values = parse(r.stdout)
    for field in dataclasses.fields(METRICS):
        name = getattr(METRICS, field.name)
        if isinstance(name, str) and name.startswith("vllm:"):
            assert name in values, name
    s = engine_sample(METRICS, values, None, None)
    assert s["kv_usage"] == 0.37 and s["running"] == 0
    assert s["counters"] == {"drafts": 100.0, "draft_tokens": 200.0, "accepted": 86.0, "generated": 0.0}
