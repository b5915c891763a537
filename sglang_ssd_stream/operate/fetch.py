"""``model fetch``: write-up 000 steps 2-3 as one command.

1. Preflight: the data dir (``$SGLANG_SSD_STREAM_HOME``, which holds the Hugging Face cache and so the
   PLE sidecar) must not be a network or memory filesystem, and must have room for what is missing.
2. Pin: each repository's revision resolves to a commit, recorded in ``state.json``; a re-run uses the
   pinned commits unless ``--update`` (or an explicit ``--*-revision``) says otherwise.
3. Download with ``huggingface_hub.snapshot_download`` into the shared cache: the prepared SSD-stream
   snapshot whole, and from the dense (HN) checkpoint only the recipe's files (configs and the
   ``model-bf16-*`` dense shards, ``allow_patterns``). Resumable: a dropped connection is resumed with a
   Range request inside the run (huggingface_hub retries 5 times), and a re-run keeps every complete file
   (and, for Xet-stored repositories, the chunks in the Xet cache); progress bars are the hub's.
4. Verify every selected file against the hub's tree listing: SHA-256 for LFS files, the git blob id for
   the small text files (the only hash the hub publishes for them). Hashes of unchanged blobs are
   remembered in ``fetch-verified.json`` (size, mtime, inode), so a re-run does not re-read 140 GiB.
   (``HfApi.verify_repo_checksums`` does the same comparison, without progress or reuse, and counts every
   file the filter left out as missing.)
5. Build the view (``model_view.build_view``: links into the cache, never copies), check it, and assert its
   counts from the dense index by the write-up's own rule (drop the ``model-plefp8-*`` shard mappings, keep
   the scale): the real model gives 297,289 mappings over 200 shards.

``state.json`` then names the view, so ``serve --profile thor`` finds the model without ``--model``.

``--in-place`` serves the PLE tables from the dense checkpoint's own ``model-plefp8-*`` shards instead of the
prepared snapshot's copied sidecar: those shards are downloaded from the dense repository, the tables the
prepared snapshot's ``ssd-stream.json`` names are not, and the view's manifest names regions of the dense shards
(``model_view.build_view(in_place=True)``; one hashing pass, kept across re-runs of the same commits). The
download is about as large either way (the same rows, from the original checkpoint rather than a copy of it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EnvironmentProblem
from .errors import ModelUpdateError, Offline

PREPARED_REPO = "garnermccloud/Qwen3.8-Flash-Next-NVFP4-SSD-Stream"  # write-up 000: experts, MTP, PLE sidecar
DENSE_REPO = "hn7305/Qwen3.8-Flash-Next-NVFP4-Spark"  # write-up 000: the dense-path NVFP4 shards and configs
# The recipe's `hf download ... --include`: configs, tokenizer, template, code and the dense shards only.
DENSE_PATTERNS = ("*.json", "*.txt", "*.model", "*.jinja", "*.py", "README.md", "model-bf16-*.safetensors")
# In place: the dense checkpoint's PLE shards (and their scale) too, served where they lie.
DENSE_IN_PLACE_PATTERNS = (*DENSE_PATTERNS, "model-plefp8-*.safetensors")
WRITEUP_VIEW_COUNTS = (297_289, 200)  # write-up 000 §3: mappings and shards of the served index
PLE_SHARD_PREFIX, PLE_SCALE = "model-plefp8-", "model-plefp8-scale.safetensors"
VERIFIED_NAME = "fetch-verified.json"
DEFAULT_REVISION = "main"
DISK_MARGIN_BYTES = 2 << 30  # besides the missing bytes: the hub's temporary files and the verify record
NETWORK_KINDS = {"network": "a network filesystem", "memory": "memory (lost on reboot; it competes with the model)"}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
CHUNK = 8 << 20


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str  # git blob id (what the hub publishes for non-LFS files)


@dataclass
class Fetched:
    repo: str
    commit: str
    snapshot: Path
    files: list[RemoteFile] = field(default_factory=list)
    downloaded_bytes: int = 0


# ----------------------------------------------------------------------------- preflight


def storage_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` must not hold the sidecar (None when it may)."""
    from ..sidecar.storage import classify_disk

    disk = classify_disk(path)
    if disk.kind in NETWORK_KINDS:
        return (f"{path} is on {NETWORK_KINDS[disk.kind]} ({disk.fstype}); the PLE sidecar is read as random 4 KiB "
                f"rows during every decode step")
    return None


def _existing(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


# ----------------------------------------------------------------------------- hub


def _api(endpoint: str | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint)


def _unreachable(exc: BaseException) -> str | None:
    """How the hub failed to answer (None: the exception is something else)."""
    from huggingface_hub.errors import HfHubHTTPError

    from .update import _is_offline_error

    if _is_offline_error(exc):
        return type(exc).__name__
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return f"HTTP {status}" if status else type(exc).__name__
    return None


def _hub_offline(what: str) -> Offline | None:
    """The refusal when a variable switched huggingface_hub offline: retrying or a mirror cannot help then."""
    from .update import hub_offline_variable

    offline = hub_offline_variable()
    if offline is None:
        return None
    return Offline(f"{offline} is set, so the model hub is not asked for {what}; model fetch needs it (it pins the "
                   f"revision and verifies every file against the hub's listing). Nothing was changed. Unset "
                   f"{offline.split('=')[0]} and retry; a model already fetched is served from state.json offline")


def _raise_if_unreachable(exc: BaseException, ref: str, did_not: str) -> None:
    """:class:`Offline` (or the refusal of a variable that switched the hub off) when ``exc`` is the hub not
    answering for ``ref``; otherwise nothing, and the caller re-raises ``exc``."""
    how = _unreachable(exc)
    if how:
        raise _hub_offline(ref) or Offline(f"the model hub {did_not} ({how}); nothing was changed. Retry, or set "
                                           f"HF_ENDPOINT to a mirror") from None


def resolve(repo: str, revision: str, *, endpoint: str | None) -> str:
    """The commit ``revision`` names on the hub (a 40-hex revision is already one)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if _COMMIT.match(revision):
        return revision
    try:
        sha = _api(endpoint).repo_info(repo, revision=revision).sha
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelUpdateError(f"{repo}@{revision}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - only the hub not answering is re-labelled
        _raise_if_unreachable(exc, f"{repo}@{revision}", f"did not answer for {repo}@{revision}")
        raise
    if not sha or not _COMMIT.match(sha):
        raise ModelUpdateError(f"{repo}@{revision}: the hub returned no commit ({sha!r})")
    return sha


def remote_files(repo: str, commit: str, patterns: tuple[str, ...] | None, *, endpoint: str | None,
                 ignore: tuple[str, ...] = ()) -> list[RemoteFile]:
    """The files the download will fetch (``patterns`` allowed, ``ignore`` left out), with the hashes the hub
    publishes for them."""
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    try:
        tree = [e for e in _api(endpoint).list_repo_tree(repo, revision=commit, recursive=True)
                if isinstance(e, RepoFile)]
    except Exception as exc:  # noqa: BLE001
        _raise_if_unreachable(exc, f"{repo}@{commit}", f"did not list {repo}@{commit}")
        raise
    wanted = set(filter_repo_objects([e.path for e in tree], allow_patterns=list(patterns) if patterns else None,
                                     ignore_patterns=list(ignore) or None))
    out = []
    for e in tree:
        if e.path in wanted:
            sha = e.lfs.sha256 if e.lfs is not None else None
            out.append(RemoteFile(e.path, int(e.lfs.size if e.lfs is not None else e.size), sha, e.blob_id))
    if not out:
        raise ModelUpdateError(f"{repo}@{commit} has no file matching {list(patterns or ['*'])}")
    return sorted(out, key=lambda f: f.path)


def cached_bytes(cache_dir: Path, repo: str, files: list[RemoteFile]) -> int:
    """Bytes of ``files`` already complete in the hub cache (blobs are named by their hash)."""
    blobs = cache_dir / ("models--" + repo.replace("/", "--")) / "blobs"
    total = 0
    for f in files:
        blob = blobs / (f.sha256 or f.blob_id)
        try:
            if blob.stat().st_size == f.size:
                total += f.size
        except OSError:
            pass
    return total


def download(repo: str, commit: str, patterns: tuple[str, ...] | None, cache_dir: Path, *,
             endpoint: str | None, progress: bool, ignore: tuple[str, ...] = ()) -> Path:
    from huggingface_hub import snapshot_download

    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(snapshot_download(repo_id=repo, revision=commit, cache_dir=str(cache_dir), endpoint=endpoint,
                                      allow_patterns=list(patterns) if patterns else None,
                                      ignore_patterns=list(ignore) or None))
    except (httpx.HTTPError, HfHubHTTPError, ConnectionError, TimeoutError) as exc:
        raise EnvironmentProblem(f"download of {repo}@{commit[:12]} stopped ({type(exc).__name__}: {exc}). Run the "
                                 f"same command again: complete files are kept, the rest is fetched") from None
    except OSError as exc:
        raise EnvironmentProblem(f"download of {repo}@{commit[:12]} into {cache_dir} failed: {exc}") from None


def sidecar_tables(repo: str, commit: str, cache_dir: Path, *, endpoint: str | None,
                   progress: bool = True) -> tuple[str, ...]:
    """The table files the prepared snapshot's ``ssd-stream.json`` names (fetched alone, into the cache; it is
    verified with the rest), as patterns that match exactly those paths: what ``--in-place`` leaves out."""
    import glob

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    from ..sidecar.format import MANIFEST_NAME

    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        path = hf_hub_download(repo, MANIFEST_NAME, revision=commit, cache_dir=str(cache_dir), endpoint=endpoint)
    except RemoteEntryNotFoundError:  # the hub says so (a Local… one is the hub not answering)
        return ()  # no sidecar there: nothing to leave out
    except Exception as exc:  # noqa: BLE001 - only the hub not answering is re-labelled
        _raise_if_unreachable(exc, f"{repo}@{commit}", f"did not give {MANIFEST_NAME} of {repo}@{commit}")
        raise
    try:
        tables = json.loads(Path(path).read_text(encoding="utf-8"))["tables"]
        paths = {r["path"] for t in tables for r in (t.get("regions") or [t])}
        if not all(isinstance(p, str) and p for p in paths):
            raise TypeError("a table path is not a string")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelUpdateError(f"{repo}@{commit[:12]}: its {MANIFEST_NAME} does not list its tables ({exc}); "
                               f"cannot tell which files --in-place leaves out. Nothing was downloaded") from None
    return tuple(glob.escape(p) for p in sorted(paths))


# ----------------------------------------------------------------------------- verification


def _record(data_dir: Path) -> dict:
    try:
        doc = json.loads((data_dir / VERIFIED_NAME).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}  # a lost record only costs a re-read


def _file_hash(path: Path, lfs: bool, bar) -> str:
    """SHA-256 of an LFS file; the git blob id (sha1 of ``blob <size>\\0`` + content) of any other."""
    h = hashlib.sha256() if lfs else hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def verify(fetched: Fetched, data_dir: Path, *, progress: bool) -> int:
    """Check every fetched file's hash; returns the bytes actually read. Raises ModelUpdateError naming
    the file, the expected and the found hash (the blob to delete so a re-run fetches it again)."""
    from tqdm.auto import tqdm

    from .update import write_text_atomic

    record = _record(data_dir)
    todo, bad = [], []
    for f in fetched.files:
        p = fetched.snapshot / f.path
        if not p.is_file():
            raise ModelUpdateError(f"{fetched.repo}@{fetched.commit[:12]}: {f.path} is missing from {fetched.snapshot} "
                                   f"after the download; run the command again")
        real = os.path.realpath(p)
        st = os.stat(real)
        if st.st_size != f.size:
            bad.append(f"{f.path}: {st.st_size} bytes, the hub lists {f.size} (blob {real})")
            continue
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        seen = record.get(real)
        if seen and seen.get("stat") == key and seen.get("expect") == (f.sha256 or f.blob_id):
            continue
        todo.append((f, real, key))
    total = sum(f.size for f, _, _ in todo)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verify {fetched.repo.split('/')[-1]}",
              disable=not progress or not todo) as bar:
        for f, real, key in todo:
            found = _file_hash(Path(real), bool(f.sha256), bar)
            expect, algo = (f.sha256, "SHA-256") if f.sha256 else (f.blob_id, "git blob id")
            if found != expect:
                bad.append(f"{f.path}: {algo} {found}, the hub lists {expect} (blob {real})")
                record.pop(real, None)
            else:
                record[real] = {"stat": key, "expect": expect}
    write_text_atomic(data_dir / VERIFIED_NAME, json.dumps(record, indent=0) + "\n")
    if bad:
        raise ModelUpdateError(f"{len(bad)} file(s) of {fetched.repo}@{fetched.commit[:12]} do not match the hub; "
                               f"nothing was switched. Delete the named blob(s) and run the command again:\n  "
                               + "\n  ".join(bad))
    return total


# ----------------------------------------------------------------------------- counts


def expected_counts(dense_index: Path) -> tuple[int, int, int]:
    """(mappings, shards, removed PLE mappings) of the served index, by write-up 000's rule: drop the
    mappings into ``model-plefp8-*`` shards, keep the scale file."""
    wm = json.loads(dense_index.read_text(encoding="utf-8"))["weight_map"]
    kept = {n: s for n, s in wm.items() if not (s.startswith(PLE_SHARD_PREFIX) and s != PLE_SCALE)}
    return len(kept), len(set(kept.values())), len(wm) - len(kept)


# ----------------------------------------------------------------------------- the command


@dataclass
class FetchResult:
    view: str
    mappings: int
    shards: int
    removed: int
    prepared: Fetched
    dense: Fetched
    notes: list[str]


def fetch_model(out: str | os.PathLike, data_dir: str | os.PathLike, *, prepared_repo: str = PREPARED_REPO,
                dense_repo: str = DENSE_REPO, prepared_revision: str | None = None, dense_revision: str | None = None,
                update: bool = False, endpoint: str | None = None, progress: bool = True, in_place: bool = False,
                log=print) -> FetchResult:
    from ..sidecar.format import INDEX_NAME
    from .model_view import build_view
    from .update import STATE_VERSION, read_state, write_state

    data_dir = Path(os.path.abspath(data_dir))
    cache_dir = data_dir / "huggingface" / "hub"
    why = storage_problem(_existing(data_dir))
    if why:
        raise EnvironmentProblem(f"refusing to download the model into {data_dir}: {why}. Set SGLANG_SSD_STREAM_HOME "
                                 f"(or --data-dir) to a local NVMe directory; nothing was changed")
    state = read_state(data_dir) or {}
    pinned = state.get("fetch", {})

    def revision_of(kind: str, repo: str, explicit: str | None) -> str:
        if explicit:
            return explicit
        old = pinned.get(kind, {})
        if not update and old.get("repo") == repo and old.get("commit"):
            return old["commit"]
        return DEFAULT_REVISION

    plan = []
    dense_patterns = DENSE_IN_PLACE_PATTERNS if in_place else DENSE_PATTERNS
    for kind, repo, rev, patterns in (("prepared", prepared_repo, prepared_revision, None),
                                      ("dense", dense_repo, dense_revision, dense_patterns)):
        revision = revision_of(kind, repo, rev)
        commit = resolve(repo, revision, endpoint=endpoint)
        ignore = (sidecar_tables(repo, commit, cache_dir, endpoint=endpoint, progress=progress)
                  if in_place and kind == "prepared" else ())
        files = remote_files(repo, commit, patterns, endpoint=endpoint, ignore=ignore)
        plan.append((kind, repo, revision, commit, patterns, ignore, files))
        log(f"{kind}: {repo}@{commit}" + (f" ({revision})" if revision != commit else " (pinned)")
            + f", {len(files)} file(s), {sum(f.size for f in files) / (1 << 30):.2f} GiB"
            + (f" (its {len(ignore)} copied PLE table file(s) left out: --in-place)" if ignore else ""))

    missing = sum(sum(f.size for f in files) - cached_bytes(cache_dir, repo, files)
                  for _, repo, _, _, _, _, files in plan)
    from ..checks.host import free_bytes
    from .update import made_for

    fetched = {}
    with made_for(cache_dir):  # a refusal or a download that wrote nothing leaves no empty folders
        free, at = free_bytes(cache_dir)
        if free < missing + DISK_MARGIN_BYTES:
            raise EnvironmentProblem(f"{free / (1 << 30):.1f} GiB free at {at}; the download needs "
                                     f"{(missing + DISK_MARGIN_BYTES) / (1 << 30):.1f} GiB "
                                     f"({missing / (1 << 30):.1f} GiB missing from the cache + margin). Write-up 000 "
                                     f"plans 180 GiB on NVMe for model, runtime and caches. Nothing was downloaded")
        log(f"cache {cache_dir}: {missing / (1 << 30):.2f} GiB to download, {free / (1 << 30):.1f} GiB free")
        for kind, repo, _revision, commit, patterns, ignore, files in plan:
            snapshot = download(repo, commit, patterns, cache_dir, endpoint=endpoint, progress=progress,
                                ignore=ignore)
            if snapshot.name != commit:
                raise ModelUpdateError(f"huggingface_hub returned {snapshot} for {repo}@{commit}")
            fetched[kind] = Fetched(repo, commit, snapshot, files)
            fetched[kind].downloaded_bytes = verify(fetched[kind], data_dir, progress=progress)

    prepared, dense = fetched["prepared"], fetched["dense"]
    report = build_view(dense.snapshot, prepared.snapshot, out, in_place=in_place, progress=progress)
    mappings, shards, removed = expected_counts(dense.snapshot / INDEX_NAME)
    if (report.mappings, report.shards, report.removed_ple_mappings) != (mappings, shards, removed):
        raise ModelUpdateError(f"the view {report.path} serves {report.mappings:,} mappings over {report.shards} "
                               f"shards ({report.removed_ple_mappings} PLE mappings removed), but the dense index "
                               f"gives {mappings:,} over {shards} ({removed} removed) by write-up 000's rule; the view "
                               f"is left for inspection, state.json is unchanged")
    notes = []
    if (prepared_repo, dense_repo) == (PREPARED_REPO, DENSE_REPO) and (mappings, shards) != WRITEUP_VIEW_COUNTS:
        notes.append(f"write-up 000's view had {WRITEUP_VIEW_COUNTS[0]:,} mappings over {WRITEUP_VIEW_COUNTS[1]} "
                     f"shards; this revision gives {mappings:,} over {shards} (the repositories changed since)")

    history = list(state.get("history", []))
    if state.get("snapshot") and state.get("snapshot") != str(prepared.snapshot):
        history.append({k: state.get(k) for k in ("model_repo", "model_revision", "snapshot")})
    import time

    write_state(data_dir, {
        **{k: v for k, v in state.items() if k not in ("history",)},
        "version": STATE_VERSION, "model_repo": prepared.repo, "model_revision": prepared.commit,
        "snapshot": str(prepared.snapshot), "view": report.path,
        "fetch": {"prepared": {"repo": prepared.repo, "commit": prepared.commit},
                  "dense": {"repo": dense.repo, "commit": dense.commit, "snapshot": str(dense.snapshot),
                            "patterns": list(dense_patterns)},
                  "ple": "in-place" if in_place else "copied"},
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "history": history})
    return FetchResult(report.path, report.mappings, report.shards, report.removed_ple_mappings, prepared, dense,
                       notes)


def add_fetch_command(subparsers):
    f = subparsers.add_parser(
        "fetch", allow_abbrev=False,
        help="write-up 000 steps 2-3: download (pinned, verified, resumable) and build the model view",
        description="Download the prepared SSD-stream snapshot and the dense shards of the HN checkpoint into the "
                    "Hugging Face cache under the data dir, verify every file against the hub's hashes, build the "
                    "model view of links (no copies), check it and its counts, and record it in state.json.")
    f.add_argument("--out", "-o", required=True, help="the model view directory to create or refresh")
    f.add_argument("--data-dir", help="holds the Hugging Face cache and state.json (default: $SGLANG_SSD_STREAM_HOME)")
    f.add_argument("--prepared-repo", default=PREPARED_REPO)
    f.add_argument("--prepared-revision", help="commit, tag or branch (default: the pinned commit, else main)")
    f.add_argument("--dense-repo", default=DENSE_REPO)
    f.add_argument("--dense-revision", help="commit, tag or branch (default: the pinned commit, else main)")
    f.add_argument("--update", action="store_true", help="move both pins to the newest main")
    f.add_argument("--in-place", action="store_true",
                   help="serve the PLE tables from the dense checkpoint's own shards (downloaded instead of the "
                        "prepared snapshot's copied tables; about as many bytes) with an in-place ssd-stream.json")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    f.set_defaults(func=cmd_fetch)
    return f


def cmd_fetch(args) -> int:
    import sys

    from ..errors import EXIT_OK
    from .update import default_data_dir

    r = fetch_model(args.out, args.data_dir or default_data_dir(), prepared_repo=args.prepared_repo,
                    dense_repo=args.dense_repo, prepared_revision=args.prepared_revision,
                    dense_revision=args.dense_revision, update=args.update, progress=not args.quiet,
                    in_place=args.in_place,
                    endpoint=os.environ.get("HF_ENDPOINT") or None,  # the recipe's mirror variable
                    log=lambda line: print(line, file=sys.stderr))
    print(f"model view: {r.view}")
    print(f"weights: {r.mappings:,} mappings, shards: {r.shards} (removed {r.removed} PLE shard mappings; counts "
          f"match the dense index)")
    print(f"prepared: {r.prepared.repo}@{r.prepared.commit}; dense: {r.dense.repo}@{r.dense.commit}")
    print("PLE tables: in place, regions of the dense checkpoint's own shards (no copy)" if args.in_place
          else "PLE tables: the prepared snapshot's copied sidecar")
    for n in r.notes:
        print(f"note: {n}")
    print(f"next: sglang-ssd-stream serve --profile thor --model {r.view} --dry-run")
    return EXIT_OK
