"""``update-model`` (where ``side.update_model``): download, verify and switch to a prepared snapshot
(:mod:`.update`)."""

from __future__ import annotations

import argparse

from ..errors import EXIT_OK

DEFAULT_MODEL_REPO = "garnermccloud/Qwen3.8-Flash-Next-NVFP4-SSD-Stream"  # the prepared snapshot of write-up 000
DEFAULT_MODEL_REVISION = "main"  # update-model updates: the branch head, resolved to a commit and pinned


def add_update_command(subparsers, side) -> argparse.ArgumentParser:
    u = subparsers.add_parser(
        "update-model", help="download, verify and switch to a prepared snapshot", allow_abbrev=False,
        description="Download the prepared snapshot (--repo at --revision, resolved to a commit) into the Hugging "
                    "Face cache under the data dir, verify its index and the PLE sidecar's SHA-256, then point "
                    "state.json at it (serve's default model). Older snapshots are kept; a failed download or "
                    "verification leaves state.json as it was. (`model fetch` also downloads the dense shards "
                    "and builds the model view.)")
    u.add_argument("--repo", default=DEFAULT_MODEL_REPO)
    u.add_argument("--revision", default=DEFAULT_MODEL_REVISION,
                   help="commit, tag or branch; the commit it resolves to is what state.json pins "
                        f"(default: {DEFAULT_MODEL_REVISION}, i.e. update to the newest, as write-up 000 step 2)")
    u.add_argument("--data-dir")
    u.add_argument("-q", "--quiet", action="store_true")
    u.set_defaults(func=cmd_update_model, side=side)
    return u


def cmd_update_model(args) -> int:
    from .update import default_data_dir, update_model

    r = update_model(args.data_dir or default_data_dir(), args.repo, args.revision, progress=not args.quiet)
    if r.changed:
        print(f"Model updated: {r.old_revision or '(none)'} -> {r.new_revision}")
        print(f"snapshot: {r.snapshot} (older snapshots are kept; state.json's history lists them)")
    else:
        print(f"Model is current: {r.repo}@{r.new_revision}")
    return EXIT_OK
