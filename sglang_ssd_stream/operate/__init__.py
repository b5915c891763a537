"""Operating the model: launch profiles, capacity planner, service files, model updates, validation.

Mount with :func:`add_operate_commands` (``subparsers, side``; each engine's adapter hands in its
:class:`.side.EngineSide`). Modules: ``side`` (what differs per engine), ``profiles`` (the one table
of flags), ``launch`` (command lines), ``preflight`` (our file checks + the adapter's doctor),
``capacity`` (planner), ``service`` (systemd/compose), ``update`` (update-model), ``model_view``
(model build-view/check-view), ``validate/``, ``watch/`` (the runtime watch); ``cli`` mounts the commands,
each family's parser and handlers in its own ``*_cli`` module. Imports neither adapter
(tests/test_import_boundaries.py).
"""

from .cli import add_operate_commands

__all__ = ["add_operate_commands"]
