"""The real OpenAI server of the cached vLLM 0.33.0 venv, on a free loopback port, on a CPU (issue 26).

:class:`VllmServer` is the sglang suite's :class:`~tests.e2e.server.SglangServer` with another command line and
environment: the lifecycle is that class's, unchanged. One server at a time (starting one stops any other this
process started, sglang's included); each runs in its own session (process group); ``stop()`` ends the whole
group (SIGTERM, then SIGKILL); an ``atexit`` hook, the conftest's SIGTERM handler and a watchdog process (which
ends the group when the test process disappears) make sure no server outlives the test run.

What a CPU box needs to run it (docs/e2e-vllm-notes.md says why, flag by flag):

* ``VLLM_TARGET_DEVICE=cpu`` (vLLM's CPU platform, its V2 model runner), ``VLLM_CPU_KVCACHE_SPACE=1``,
  ``TRITON_INTERPRET=1``;
* the test-owned stand-ins (``tests/e2e/vllm_cpu_standin/``) on ``PYTHONPATH``: its ``sitecustomize`` arms them
  in each of vLLM's processes;
* ``VLLM_PLUGINS=ple_offload``: the kit's general plugin by the entry point the venv's install declares;
* :data:`SERVE_ARGS`: caps for a 2-core box, eager mode, no vision tower, every ``CustomOp`` in torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..e2e.server import REPO, WATCHDOG, SglangServer, _live, stop_all
from ..engine import HUMMING_NO_BACKGROUND_BUILD

STANDIN = REPO / "tests" / "e2e" / "vllm_cpu_standin"
SERVED_NAME = "qwen4-tiny"
SERVE_ARGS = [
    "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
    "--enforce-eager",  # no torch.compile / graphs on the CPU path
    "--language-model-only",  # no vision tower (vLLM reads vision fields the tiny checkpoint lacks)
    "-cc", json.dumps({"custom_ops": ["none"]}),  # every CustomOp takes its torch forward_native
    "--served-model-name", SERVED_NAME,
]
BASE_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "VLLM_TARGET_DEVICE": "cpu",  # CPU platform (vLLM cannot infer a device without a GPU)
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: no memory probe of the whole box
    "TRITON_INTERPRET": "1",  # vLLM's Triton kernels run on CPU tensors in the interpreter
    "VLLM_PLUGINS": "ple_offload",  # the kit's general plugin (vLLM loads only the plugins named here)
    "HUMMING_DISABLE_PARALLEL_BUILD": HUMMING_NO_BACKGROUND_BUILD,
}


@dataclass(eq=False)
class VllmServer(SglangServer):
    """``python -m vllm.entrypoints.openai.api_server`` with the kit's plugin and the CPU stand-ins.

    ``env`` holds the scenario's ``VLLM_PLE_*`` (nothing of the caller's environment starting with ``VLLM_``
    reaches the server). ``driver_dir`` is unused (vLLM needs no stub CUDA driver on its CPU platform)."""

    driver_dir: Path | None = None

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--host", "127.0.0.1", "--port", str(self.port), *SERVE_ARGS, *self.args]

    def start(self) -> VllmServer:
        stop_all()  # never two servers at once
        self.home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST_", "SGLANG_", "SSD_STREAM_", "VLLM_"))}
        env.update(BASE_ENV)
        env.update({"HOME": str(self.home), "PYTHONPATH": os.pathsep.join([str(STANDIN), str(REPO)])})
        env.update(self.env)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.home, start_new_session=True)
        _live.add(self)
        subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(self.proc.pid)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        return self

    def greedy(self, prompt, max_tokens: int, *, timeout: float = 300.0) -> dict:
        """``/v1/completions``, greedy, top-1 logprobs and token ids back; ``prompt`` is text or token ids.
        Returns what the tests compare: prompt and output token ids, output logprobs, finish reason."""
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": 1, "return_token_ids": True}
        r = self.post("/v1/completions", body, timeout=timeout)
        r.raise_for_status()
        answer = r.json()
        choice = answer["choices"][0]
        return {"prompt_token_ids": choice.get("prompt_token_ids"), "token_ids": choice.get("token_ids"),
                "logprobs": choice["logprobs"]["token_logprobs"], "text": choice["text"],
                "finish_reason": choice["finish_reason"], "completion_tokens": answer["usage"]["completion_tokens"]}
