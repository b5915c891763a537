"""``update-model``: fetch a prepared snapshot at an explicit revision, verify it, then switch.

Layout under the data dir (``$SGLANG_SSD_STREAM_HOME``, default ``~/.cache/sglang-ssd-stream``)::

    huggingface/hub/models--<org>--<name>/snapshots/<commit>/   # huggingface_hub's cache
    state.json    {"version": 1, "model_repo", "model_revision", "snapshot", "history": [...]}

The state file changes only after the new snapshot passed verification (temp file, fsync,
``os.replace``). Old snapshots are never deleted here: rolling back is editing nothing but
state.json, and ``hf cache`` prunes when the operator decides.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic_file import write_atomic
from ..errors import EnvironmentProblem
from ..paths import data_dir as kit_data_dir
from .errors import ModelUpdateError, Offline

STATE_NAME = "state.json"
STATE_VERSION = 1
REQUIRED_FILES = ("config.json", "model.safetensors.index.json", "ssd-stream.json")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def default_data_dir() -> Path:
    return kit_data_dir()


def read_state(data_dir: str | os.PathLike) -> dict | None:
    p = Path(data_dir) / STATE_NAME
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelUpdateError(f"{p} is unreadable ({exc}); fix or remove it") from None
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION or not isinstance(doc.get("snapshot"), str):
        raise ModelUpdateError(f"{p} is not a version-{STATE_VERSION} state file")
    return doc


def write_state(data_dir: str | os.PathLike, doc: dict) -> None:
    write_text_atomic(Path(data_dir) / STATE_NAME, json.dumps(doc, indent=2) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory (:mod:`..atomic_file`)."""
    write_atomic(path, text)


def check_snapshot(snapshot: str | os.PathLike, *, progress: bool = True, required=REQUIRED_FILES) -> dict:
    """Index completeness and sidecar SHA-256; raises ModelUpdateError naming what is wrong."""
    from ..errors import KitError
    from ..sidecar.format import load_manifest
    from ..sidecar.verify import BUILD, verify_sidecar

    root = Path(snapshot)
    missing = [name for name in required if not (root / name).is_file()]
    if missing:
        raise ModelUpdateError(f"snapshot {root} lacks {', '.join(missing)}")
    indexes = [root / "model.safetensors.index.json"]
    if (root / "mtp" / "model.safetensors.index.json").is_file():
        indexes.append(root / "mtp" / "model.safetensors.index.json")
    shards = 0
    for idx in indexes:
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
            names = set(weight_map.values())
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
            raise ModelUpdateError(f"{idx}: no usable weight_map ({exc})") from None
        absent = sorted(n for n in names if not (idx.parent / n).is_file())
        if absent:
            raise ModelUpdateError(f"{idx} maps tensors to missing shard(s): {', '.join(absent[:5])}"
                                   + (f" and {len(absent) - 5} more" if len(absent) > 5 else ""))
        shards += len(names)
    try:
        manifest = load_manifest(root)
        # the snapshot this command wrote: its writer records the verification, as `sidecar build` does
        report = verify_sidecar(manifest, caller=BUILD, use_cache=False, progress=progress, raise_on_mismatch=True)
    except KitError as exc:
        raise ModelUpdateError(f"PLE sidecar of {root} failed verification: {exc.message}") from None
    return {"shards": shards, "tables": len(report.tables)}


@dataclass(frozen=True)
class UpdateResult:
    repo: str
    old_revision: str | None
    new_revision: str
    snapshot: str
    changed: bool


def hub_offline_variable() -> str | None:
    """``NAME=value`` of the variable that switches huggingface_hub offline (its own rule), else None."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:  # huggingface_hub reads the first one set
            return f"{name}={value}" if value.upper() in ("1", "ON", "YES", "TRUE") else None
    return None


@contextlib.contextmanager
def made_for(path: Path):
    """Create ``path`` and its missing parents; when the body fails, remove the ones that are still empty,
    so a download that wrote nothing leaves nothing behind (a partial one keeps its files: a re-run resumes)."""
    created = []
    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        created.append(p)
        p = p.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot create {path}: {exc.strerror}") from None
    try:
        yield
    except BaseException:
        if created:
            for root, _, _ in os.walk(created[-1], topdown=False):
                with contextlib.suppress(OSError):  # not empty: something was downloaded
                    os.rmdir(root)
        raise


def _is_offline_error(exc: BaseException) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return True
    try:
        import httpx
        if isinstance(exc, (httpx.ConnectError, httpx.TimeoutException)):
            return True
    except ImportError:  # pragma: no cover - httpx comes with huggingface_hub
        pass
    return isinstance(exc, (ConnectionError, TimeoutError))


def fetch(repo: str, revision: str, cache_dir: Path, *, progress: bool) -> Path:
    """Download (or find in the cache) ``repo`` at ``revision``; offline problems become Offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    kwargs = dict(repo_id=repo, revision=revision, cache_dir=str(cache_dir))
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return Path(snapshot_download(**kwargs))
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelUpdateError(f"{repo}@{revision}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - only network-shaped errors are re-labelled below
        if not _is_offline_error(exc):
            raise
        first = exc
    try:  # a revision already in the cache still verifies and switches without the network
        return Path(snapshot_download(**kwargs, local_files_only=True))
    except Exception:  # noqa: BLE001
        offline = hub_offline_variable()
        if offline:
            raise Offline(f"cannot reach the model hub for {repo}@{revision} ({offline} is set: huggingface_hub "
                          f"does not ask it) and it is not in {cache_dir}. Nothing was changed. Unset "
                          f"{offline.split('=')[0]} and retry") from None
        raise Offline(
            f"cannot reach the model hub for {repo}@{revision} and it is not in {cache_dir} "
            f"({type(first).__name__}). Nothing was changed. Connect (or set HF_ENDPOINT to a mirror) and retry"
        ) from None


def update_model(data_dir: str | os.PathLike, repo: str, revision: str, *, progress: bool = True) -> UpdateResult:
    if not revision:
        raise ModelUpdateError("an empty revision names nothing; pass a commit, tag or branch (default: main)")
    data_dir = Path(data_dir)
    state = read_state(data_dir)
    cache_dir = data_dir / "huggingface" / "hub"
    with made_for(cache_dir):
        snapshot = fetch(repo, revision, cache_dir, progress=progress)
    commit = snapshot.name
    if not _COMMIT.match(commit):
        raise ModelUpdateError(f"huggingface_hub returned an unversioned snapshot {snapshot}")
    old = state.get("model_revision") if state and state.get("model_repo") == repo else None
    if state and state.get("snapshot") == str(snapshot):
        return UpdateResult(repo, old, commit, str(snapshot), changed=False)
    check_snapshot(snapshot, progress=progress)
    history = list(state.get("history", [])) if state else []
    if state:
        history.append({"model_repo": state.get("model_repo"), "model_revision": state.get("model_revision"),
                        "snapshot": state["snapshot"]})
    write_state(data_dir, {"version": STATE_VERSION, "model_repo": repo, "model_revision": commit,
                           "requested_revision": revision, "snapshot": str(snapshot),
                           "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "history": history})
    return UpdateResult(repo, old, commit, str(snapshot), changed=True)
