"""The shared staging's raw delivery (what vLLM's ``mmap``/``pread`` backends run) in the vLLM venv.

The tests are the engine-neutral ones of ``tests/staging/test_gather.py`` (the SGLang suite runs them
too): rows bit-identical to the table for random, boundary and duplicate ids and TP ranges over both
readers, refused ids with the output untouched, the captured path's native host node. Here they run
against the torch vLLM 0.33.0 pins; the real plugin and embedding: ``checks/check_plugin_streamed.py``.
"""

from tests.staging.test_gather import *  # noqa: F401,F403  (pytest collects the imported tests and fixtures)
