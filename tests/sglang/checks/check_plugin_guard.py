"""Runs inside the sglang venv: the real load_plugins() with our entry point selected.

EXPECT=start   load_plugins() returns and our plugin ran (knob applied)
EXPECT=refuse  load_plugins() raises SystemExit naming the fix
FAIL_PLE_HOOKS=1 makes arming the PLE hooks raise, as a renamed upstream target would
"""

import os

import pytest


def test_guard():
    from sglang.srt.plugins import load_plugins

    import sglang_ssd_stream.sglang.plugin as plugin

    if os.environ.get("FAIL_PLE_HOOKS") == "1":
        from sglang_ssd_stream.sglang import hooks

        def broken_install():
            raise RuntimeError("hook target sglang.srt.model_loader.utils.get_model_architecture is missing")

        hooks.install_for_served_model = broken_install

    if os.environ["EXPECT"] == "refuse":
        with pytest.raises(SystemExit) as exc:
            load_plugins()
        assert os.environ["EXPECT_MESSAGE"] in str(exc.value)
        assert not plugin._registered
    else:
        load_plugins()
        assert plugin._registered
        from sglang.srt.layers.attention.qsa import qsa_indexer

        assert qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES == int(os.environ["EXPECT_BUDGET_MB"]) << 20
