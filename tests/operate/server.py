"""A real OpenAI-compatible server for the validation tests: ``transformers serve`` on 127.0.0.1
with a tiny random-weight Qwen2 model and a byte-level BPE tokenizer, both built at test time
(no download; the machine reaches no model hub)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..e2e.server import shared_tls

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_model(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from sglang_ssd_stream.operate.validate.filler import Filler

    # Byte-level BPE trained here on our own filler: decoding round-trips exactly, like real tokenizers.
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([Filler(7).text(20000), "0123456789 secret code number Reply JSON"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=special[1:2])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    vocab = tok.get_vocab()
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=vocab["<|im_end|>"], pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, home: Path):
        self.model, self.port = str(model), free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        exe = Path(sys.executable).parent / "transformers"
        env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.log = open(home / "serve.log", "w")
        self.proc = subprocess.Popen([str(exe), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                                      "--device", "cpu", "--default-seed", "0"], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited {self.proc.returncode}: {self.log_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", verify=shared_tls(), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"transformers serve not ready in {timeout} s: {self.log_text()[-2000:]}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own process group (start_new_session)
            self.proc.wait(30)

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.kill()
        self.log.close()
