"""`vllm-ple-offload serve`'s PROMETHEUS_MULTIPROC_DIR against vLLM 0.33.0's own registry: in the environment serve
hands the engine, a value written by another process (a worker's, as the kit's ``ssd_stream_*`` series are) is in
what vLLM's ``get_prometheus_registry`` serves at ``/metrics``, and the next start's registry has none of it."""

from __future__ import annotations

import subprocess

from ..operate.conftest import write_model

VAR = "PROMETHEUS_MULTIPROC_DIR"
WORKER = "from prometheus_client import Counter; Counter('ssd_stream_probe', 'a worker value').inc(3)"
API_SERVER = ("from prometheus_client import generate_latest; from vllm.v1.metrics.prometheus import "
              "get_prometheus_registry; print(generate_latest(get_prometheus_registry()).decode())")


def test_a_workers_value_reaches_vllms_registry_and_never_the_next_start(vllm, tmp_path, monkeypatch):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands
    from vllm_ple_offload import doctor
    from vllm_ple_offload.side import SIDE

    monkeypatch.setattr(doctor, "preflight", lambda **kw: [])  # this CPU box has no GPU: the launch line only
    monkeypatch.delenv(VAR, raising=False)
    parser = argparse.ArgumentParser()
    add_operate_commands(parser.add_subparsers(dest="command", required=True), SIDE)
    model = write_model(tmp_path / "model", sidecar=False, draft=False)
    args = parser.parse_args(["serve", "--profile", "a100x4", "--model", str(model)])
    scraped = []

    def engine(file, argv, env):  # a worker writes, then the API server's registry is read, in vLLM's venv
        extra = {VAR: env[VAR]} if VAR in env else {}
        for code in (WORKER, API_SERVER)[len(scraped):]:
            r = subprocess.run([vllm.python, "-c", code], env=vllm.env(extra), capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
        scraped.append(r.stdout)

    assert args.func(args, exec_fn=engine) == 0  # first start: a worker, then a scrape
    assert "ssd_stream_probe_total 3.0" in scraped[0], scraped[0]
    assert args.func(args, exec_fn=engine) == 0  # next start: a scrape only
    assert "ssd_stream_probe" not in scraped[1], scraped[1]
