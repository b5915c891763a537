"""The model's config.json as the engine will load it: transformers' own config class (both sglang 0.5.23
and vllm 0.33.0 build qwen4_exp's config with ``AutoConfig``), run before the launch.

A config the engine would reject at start (e.g. transformers' ``Qwen4ExpConfig`` validating that the RoPE
dimensions fit the QSA index head) is an error finding naming the field, not a server that dies after
loading. Where transformers is not installed (a planning box without the runtime) nothing is claimed.
"""

from __future__ import annotations

import os

from ..findings import ERROR, OK, Finding


def engine_config_finding(path: str | os.PathLike, check: str = "model_config") -> Finding | None:
    """None when transformers is not importable here; else whether its config class accepts ``path``."""
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError:
        return None
    # checked first: transformers takes a path that is not a folder for a hub repo id and advises on its name
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.lexists(path) else "no such directory"
        return Finding(ERROR, check, f"{path}: {what}; the model is a folder holding config.json",
                       "pass the model view's folder (sglang-ssd-stream model fetch builds it)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return Finding(ERROR, check, f"{path} has no config.json",
                       "pass the model view's folder (sglang-ssd-stream model fetch builds it)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the engine's loader raises is the refusal to report
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = " ".join(lines[:3])[:600] or type(exc).__name__
        return Finding(ERROR, check, f"transformers {transformers.__version__} (the engine's config loader) refuses "
                       f"{path}/config.json: {why}",
                       "fix config.json (a re-download with `model fetch` restores the published one); the engine "
                       "would stop at start with this error")
    return Finding(OK, check, f"{path}/config.json loads as {type(config).__name__} (transformers "
                   f"{transformers.__version__})")
