"""A local HTTP endpoint that answers the few Hugging Face Hub calls ``model fetch`` makes (repo info, the
recursive tree with LFS hashes, HEAD/GET of resolve URLs with Range), for synthetic repositories."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    lfs: set[str] = field(default_factory=set)  # paths stored as LFS (hash: SHA-256)
    published: dict[str, bytes] = field(default_factory=dict)  # what the tree lists, when it differs (tampering)

    def entry(self, path: str) -> dict:
        listed = self.published.get(path, self.files[path])
        e = {"type": "file", "oid": git_blob_id(listed), "size": len(listed), "path": path}
        if path in self.lfs:
            e["lfs"] = {"oid": hashlib.sha256(listed).hexdigest(), "size": len(listed), "pointerSize": 134}
        return e

    def etag(self, path: str) -> str:
        e = self.entry(path)
        return e["lfs"]["oid"] if "lfs" in e else e["oid"]


class Hub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.drop_once: dict[str, int] = {}  # file path -> bytes to send before dropping the first GET
        self.down = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _json(self, obj, code=200, error_code=None):
                body = json.dumps(obj).encode()
                self.send_response(code)
                if error_code:  # what the hub sends so huggingface_hub raises its typed errors
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", obj["error"])
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _route(self):
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                if hub.down:
                    self.close_connection = True
                    return self._json({"error": "down"}, 503)
                parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
                if parts[:2] == ["api", "models"]:
                    repo = hub.repos.get("/".join(parts[2:4]))
                    if repo is None:
                        return self._json({"error": "Repository not found"}, 404, "RepoNotFound")
                    if parts[4] == "revision":
                        if parts[5] not in ("main", repo.commit):
                            return self._json({"error": "Revision not found"}, 404, "RevisionNotFound")
                        return self._json({"id": "/".join(parts[2:4]), "sha": repo.commit,
                                           "siblings": [{"rfilename": p} for p in sorted(repo.files)]})
                    if parts[4] == "tree":
                        dirs = sorted({p.rsplit("/", 1)[0] for p in repo.files if "/" in p})
                        return self._json([{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in dirs]
                                          + [repo.entry(p) for p in sorted(repo.files)])
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = hub.repos.get("/".join(parts[:2]))
                    path = "/".join(parts[4:])
                    if repo is None or path not in repo.files:
                        return self._json({"error": "Entry not found"}, 404, "EntryNotFound")
                    return self._file(repo, path)
                return self._json({"error": "unknown route"}, 404)

            def _file(self, repo, path):
                data = repo.files[path]
                start = 0
                rng = self.headers.get("Range")
                if rng and self.command == "GET":
                    start = int(rng.split("=")[1].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("ETag", f'"{repo.etag(path)}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if self.command == "HEAD":
                    return
                cut = hub.drop_once.pop(path, None)
                if cut is not None:
                    self.wfile.write(data[start:start + cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

            do_GET = do_HEAD = _route

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def gets(self, suffix: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and "/resolve/" in r[1] and unquote(r[1]).endswith(suffix)]
