"""vLLM general plugin for Qwen3.8 Flash-Next PLE offload (stdlib-only at import time)."""
