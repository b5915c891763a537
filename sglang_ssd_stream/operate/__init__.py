"""Operating the model: launch profiles, capacity planner, service files, model updates, validation.

Mount with :func:`add_operate_commands` (``subparsers, engine="sglang"|"vllm"``). Modules:
``profiles`` (the one table of flags), ``launch`` (command lines), ``preflight`` (doctor seam),
``capacity`` (planner), ``service`` (systemd/compose), ``update`` (update-model), ``validate/``.
"""

from .cli import add_operate_commands

__all__ = ["add_operate_commands"]
