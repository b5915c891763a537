"""Proof 1: the kit's plugin is live in each of the real vLLM server's processes.

vLLM runs the general plugin in every process it starts: the API server (the launcher), the engine core and the
worker. With a streamed backend each of them logs the plugin's guard verdict. The shared venv is pristine and the
suite never patches it, so the verdict is "UNPATCHED ... accepted because VLLM_PLE_ALLOW_UNPATCHED=1" (every
streamed scenario sets it). The processes that import vLLM's qwen4_exp model module (the API server, resolving
the model class, and the worker, building the model) then swap ``StreamedPLEEmbedding`` in and say so with their
pid; the engine core never imports the model module. Without any ``VLLM_PLE_*`` the plugin does nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_ssd_stream.sidecar.format import load_manifest

VERDICT = (r"vllm-ple-offload: \[warning\] source: vllm 0\.33\.0 is UNPATCHED \(.+=pristine\); accepted because "
           r"VLLM_PLE_ALLOW_UNPATCHED=1")
STREAMED = ["streamed_mmap", "streamed_pread"]


def _processes(sc) -> dict[str, int]:
    """role -> pid of the three processes, each named by vLLM's line prefixes and seen in the server's group."""
    roles = sc.role_pids()
    assert roles["api_server"] == {sc.leader}, roles  # the launcher is the API server
    assert len(roles["engine_core"]) == 1 and len(roles["worker"]) == 1, roles
    pids = {role: next(iter(p)) for role, p in roles.items()}
    assert len(set(pids.values())) == 3, pids
    assert set(pids.values()) <= set(sc.pids), (pids, sc.pids)  # live members of the group while it served
    return pids


@pytest.mark.parametrize("name", STREAMED)
def test_guard_verdict_in_each_process(request, name):
    sc = request.getfixturevalue(name)
    pids = _processes(sc)
    for role, pid in pids.items():
        assert sc.grep(VERDICT, pid), f"{role} (pid {pid}): no guard verdict\n{sc.log[-4000:]}"
    # once per process, no more: the launcher, the engine core, the worker
    assert len(sc.grep(VERDICT)) == 3, sc.grep(VERDICT)


@pytest.mark.parametrize("name", STREAMED)
def test_streamed_embedding_in_api_server_and_worker(request, name):
    sc = request.getfixturevalue(name)
    backend = sc.env["VLLM_PLE_OFFLOAD_BACKEND"]
    pids = _processes(sc)
    for role in ("api_server", "worker"):
        pid = pids[role]
        swap = (rf"vllm-ple-offload: qwen4_exp PLE tables use StreamedPLEEmbedding \(backend={backend} .*\) "
                rf"in pid {pid}$")
        assert sc.grep(swap, pid), f"{role} (pid {pid}): no StreamedPLEEmbedding line\n{sc.log[-4000:]}"
    # the engine core schedules; it never imports the model module, so it has nothing to swap
    assert not sc.grep("StreamedPLEEmbedding", pids["engine_core"])
    # the worker built both PLE layers on the sidecar's tables (in place: named by their first region's shard)
    manifest = load_manifest(Path(sc.env["VLLM_PLE_SIDECAR"]))
    for layer in (0, 1):
        table = manifest.table(layer)
        where = str(table.file) if table.in_place else f"{sc.env['VLLM_PLE_SIDECAR']}/ple/layer-{layer}.bin"
        assert sc.grep(rf"sidecar {re.escape(where)} rows \[0, \d+\), {backend} reads", pids["worker"]), \
            sc.log[-4000:]
    assert sc.grep(r"Using V2 Model Runner", pids["worker"])  # the runner the prompt-ahead prefetch hooks


def test_row_cache_and_prefetch_per_configuration(streamed_mmap, streamed_pread):
    """(b) runs the default row cache with prompt-ahead prefetch in the worker; (c) has the cache off."""
    worker = _processes(streamed_mmap)["worker"]
    assert streamed_mmap.grep(r"row_cache=1024 MiB prefetch_chunks=1\) in pid", worker)
    assert streamed_mmap.grep(r"PLE prompt-ahead prefetch: 2 layer\(s\)", worker), streamed_mmap.log[-4000:]
    worker = _processes(streamed_pread)["worker"]
    assert streamed_pread.grep(r"row_cache=off\) in pid", worker)
    assert len(streamed_pread.grep(r"pread reads x \d+, no row cache", worker)) == 2  # both PLE layers
    assert not streamed_pread.grep(r"prompt-ahead prefetch")


def test_plugin_does_nothing_without_knobs(vllm_table):
    """(a): VLLM_PLUGINS names the plugin, no VLLM_PLE_* is set: no guard, no swap, vLLM's own table and lookup."""
    sc = vllm_table
    assert "vllm-ple-offload" not in sc.log, [ln for ln in sc.log.splitlines() if "vllm-ple-offload" in ln][:5]
    pids = _processes(sc)
    assert sc.grep(r"ran torch\.empty\(pin_memory=True\) -> ordinary memory", pids["worker"]), sc.log[-4000:]
    assert sc.grep(r"ran _lookup_ple_embedding_from_pinned_kernel", pids["worker"])
