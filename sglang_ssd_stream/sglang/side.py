"""The SGLang row of the shared operate commands (:class:`~sglang_ssd_stream.operate.side.EngineSide`)."""

from __future__ import annotations

from ..operate.side import EngineSide, python_module
from .config import DEFAULT_WORKERS, WORKERS_ENV


def _preflight(**launch) -> list:
    from . import doctor  # looked up at call time: tests stand in a doctor by patching doctor.preflight

    return doctor.preflight(**launch)


SIDE = EngineSide(
    name="sglang",
    display="SGLang",
    tool="sglang-ssd-stream",
    launcher=python_module("sglang.launch_server"),
    preflight=_preflight,
    service="systemd",
    max_served_names=1,
    draft_option=True,
    update_model=True,
    install_hint="./install.sh --engine sglang",
    thread_knobs=((WORKERS_ENV, DEFAULT_WORKERS),),  # the PLE sidecar's reader pool (mmap and pread)
)
