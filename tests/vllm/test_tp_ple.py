"""Issue 7 (CPU part): TP ranks on gloo assemble the TP=1 PLE rows, in the real vLLM venv.

The engine-neutral driver (``tests/vllm/tp_ple.py``) also runs in the SGLang venv with
``--engine sglang``; see that module's docstring.
"""

from __future__ import annotations

from ..engine import outcomes_only


def test_tp_checks(vllm):
    result = vllm.run_checks("tests/vllm/checks/check_tp_ple.py")
    outcomes = outcomes_only(result)
    # The message is the check run's own output, as a string: pytest would cut a repr'd tuple short.
    assert len(outcomes) == 6 and set(outcomes.values()) == {"passed"}, f"{outcomes}\n{result['__output__']}"
