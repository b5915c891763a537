"""What ``watch`` reads from vLLM 0.33.0's ``/metrics`` (``v1/metrics/loggers.py``, ``v1/spec_decode/metrics.py``).

For the vLLM row of the operate commands: ``side.py`` hands it in as ``EngineSide(metrics=METRICS)``.
vLLM exports the speculative-decoding counters only (drafts, draft tokens, accepted tokens); ``watch``
turns them into the interval's acceptance rate and accept length.
"""

from __future__ import annotations

from sglang_ssd_stream.operate.metrics import MetricNames

METRICS = MetricNames(
    kv_usage="vllm:kv_cache_usage_perc", running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
    drafts_total="vllm:spec_decode_num_drafts_total", draft_tokens_total="vllm:spec_decode_num_draft_tokens_total",
    accepted_total="vllm:spec_decode_num_accepted_tokens_total",
    generation_tokens_total="vllm:generation_tokens_total",
    enable_hint="vllm serve exposes /metrics by default")
