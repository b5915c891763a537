"""The fork server ("zygote") of an engine venv: run by tests/forkserver.py as ``python tests/zygote.py CONFIG``.

Standard library only, never imported as part of the ``tests`` package (it runs as ``__main__``). It:

1. forks a *probe* that imports the engine's heavy entry modules (``CONFIG["entries"]``) and reports, in import
   order, the modules that came with them and the environment reads and writes made while they loaded;
2. imports every module of that list that belongs to neither the engine, the kit nor the tests
   (``CONFIG["excluded"]``), in the same order, replaying the engine's own environment writes at the point where
   the probe saw them (sglang points FlashInfer's and Inductor's caches under $HOME before it imports them), and
   records which variables the imported modules read;
3. answers ``ready`` with what the client's rule needs (tests/forkserver.py), then serves ``run`` requests: each
   is a fork whose child takes its own session, replaces ``os.environ``, cwd, ``sys.argv``, ``sys.path[0]`` and
   ``__main__`` as ``python -m pytest`` would have them, sends stdout/stderr to files and runs pytest's
   ``__main__`` (or, for a request naming a ``script``, that script as ``python SCRIPT ARGS`` runs it); the
   interpreter then exits as any process does (threads joined, atexit handlers run).

It reads its requests on stdin and exits when stdin ends (its parent, the outer pytest, is gone), killing a check
it still runs. No Python threads before a fork: the zygote only imports (``ready`` reports its thread counts).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import types

CONFIG = json.loads(sys.argv[1])
EXCLUDED = tuple(CONFIG["excluded"])  # top-level packages never imported here (the engine, the kit, the tests)
SCANS = CONFIG["scans"]  # module -> the prefix its environment scan looks for (the client's table)
# pytest and what pytest imports as a plugin (entry points "pytest11") stay out too: pytest rewrites the asserts of
# the plugins it imports itself, and warns about those already imported
PYTEST_OWN = ("pytest", "_pytest", "pluggy", "iniconfig", "py")
REPLY = os.fdopen(CONFIG["reply_fd"], "w", buffering=1)
REQUESTS = sys.stdin.buffer


def _pytest_plugins() -> set[str]:
    from importlib.metadata import entry_points

    tops = set(PYTEST_OWN)
    for ep in entry_points(group="pytest11"):
        tops.add(ep.value.split(":")[0].split(".")[0])
        try:
            tops.update((ep.dist.read_text("top_level.txt") or "").split())
        except Exception:  # noqa: BLE001 - a dist without metadata files: its entry point's package is enough
            pass
    return tops


def _excluded(name: str) -> bool:
    return name.split(".", 1)[0] in EXCLUDED or name in ("__main__", "__mp_main__")


def _seen(key: str, caller: str, scan: bool) -> bool:
    """Whether a read could have told ``caller`` something about ``key``: a known prefix scan reads every key
    (a dependency's reads all are its scan's; the engine's, those made through an iteration)."""
    if caller in SCANS and (scan or not _excluded(caller)):
        return key.startswith(SCANS[caller])
    return True


def _reply(**msg) -> None:
    REPLY.write(json.dumps(msg) + "\n")
    REPLY.flush()


def _text(x) -> str:
    return os.fsdecode(x) if isinstance(x, (str, bytes)) else repr(x)


class _Recorder:
    """Python-level reads, writes and scans of ``os.environ`` with the position (modules loaded so far) and the
    module that made them; C code calling getenv() is not seen."""

    def __init__(self):
        self.base = len(sys.modules)
        self.reads: list = []  # [key, pos, caller, during an iteration]
        self.writes: list = []  # [key, value or None, pos, caller]
        self.scans: list = []  # [pos, caller]
        cls = type(os.environ)
        self._orig = {n: getattr(cls, n) for n in ("__getitem__", "__iter__", "__setitem__", "__delitem__")}
        rec = self
        orig = self._orig

        def getitem(env, key):
            rec.reads.append([_text(key), rec.pos(), *rec.caller()])  # os.environb's keys are bytes
            return orig["__getitem__"](env, key)

        def iterate(env):
            rec.scans.append([rec.pos(), rec.caller()[0]])
            return orig["__iter__"](env)

        def setitem(env, key, value):
            rec.writes.append([_text(key), _text(value), rec.pos(), rec.caller()[0]])
            return orig["__setitem__"](env, key, value)

        def delitem(env, key):
            rec.writes.append([_text(key), None, rec.pos(), rec.caller()[0]])
            return orig["__delitem__"](env, key)

        self._new = {"__getitem__": getitem, "__iter__": iterate, "__setitem__": setitem, "__delitem__": delitem}

    def pos(self) -> int:
        return len(sys.modules) - self.base

    @staticmethod
    def caller() -> tuple[str, bool]:
        """The module that touched the environment, and whether through an iteration (``os.environ.items()``)."""
        f, scan = sys._getframe(2), False
        while f is not None and (f.f_code.co_filename.endswith(("/os.py", "/_collections_abc.py"))
                                 or f.f_code.co_filename.startswith("<frozen")):
            scan = scan or f.f_code.co_name == "__iter__"
            f = f.f_back
        return (str(f.f_globals.get("__name__")) if f is not None else "?"), scan

    def __enter__(self):
        for n, fn in self._new.items():
            setattr(type(os.environ), n, fn)
        return self

    def __exit__(self, *exc):
        for n, fn in self._orig.items():
            setattr(type(os.environ), n, fn)


class _StartOrder:
    """A meta path finder that finds nothing and notes each import as it starts (sys.modules holds them in the
    order they finished: a package after its submodules)."""

    def __init__(self):
        self.started: list[str] = []

    def find_spec(self, name, path=None, target=None):
        self.started.append(name)
        return None


def probe(entries: list[str], out_fd: int) -> None:
    """In a forked child: import the engine's entry modules, write what came with them, exit. Positions are
    counted in imports started, so that the zygote replays the engine's writes between the same imports."""
    before = set(sys.modules)
    order = _StartOrder()
    sys.meta_path.insert(0, order)
    errors = []
    with _Recorder() as rec:
        rec.pos = lambda: len(order.started)
        for entry in entries:
            try:
                __import__(entry)
            except BaseException as exc:  # noqa: B036 - a probe that fails still reports what it loaded
                errors.append(f"{entry}: {exc!r}")
    sys.meta_path.remove(order)
    modules = []
    for name in order.started:
        mod = sys.modules.get(name)
        if name in before or mod is None:
            modules.append([name, False])  # keeps the positions: what did not load is not imported
            continue
        spec = getattr(mod, "__spec__", None)
        modules.append([name, spec is not None and spec.name == name])  # importable under its own name
    text = json.dumps({"modules": modules, "reads": rec.reads, "writes": rec.writes, "scans": rec.scans,
                       "errors": errors}, default=repr)  # whole or not at all: a key may be no string
    with os.fdopen(out_fd, "w") as out:
        out.write(text)
    os._exit(0)


def run_probe(entries: list[str]) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):  # the probe's prints (engine banners) go nowhere; stderr stays the zygote's log
            os.dup2(devnull, fd)
        try:
            probe(entries, w)
        finally:
            os._exit(70)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while chunk := f.read(1 << 20):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b"{}")


def preimport(found: dict) -> dict:
    """Import the probe's non-engine modules in its order, replaying the engine's environment writes that a
    module imported later read (their inputs are then fixed: the client lets none of them differ)."""
    engine_writes = [w for w in found.get("writes", []) if _excluded(w[3])]
    late_reads = {}  # key -> positions where non-engine code read it
    for key, pos, caller, scan in found.get("reads", []):
        if not _excluded(caller) and _seen(key, caller, scan):
            late_reads.setdefault(key, []).append(pos)
    replays = [w for w in engine_writes if any(p >= w[2] for p in late_reads.get(w[0], []))]
    last = max((w[2] for w in replays), default=-1)
    replay_inputs = sorted({k for k, pos, caller, scan in found.get("reads", [])
                            if _excluded(caller) and pos <= last and _seen(k, caller, scan)})
    replay_scans = sorted({caller for pos, caller in found.get("scans", []) if _excluded(caller) and pos <= last})

    start_env = dict(os.environ)
    pending = sorted(replays, key=lambda w: w[2])
    plugins = _pytest_plugins() | set(CONFIG.get("avoid", []))
    order = [(i, name) for i, (name, own) in enumerate(found.get("modules", []))
             if own and not _excluded(name) and name.split(".", 1)[0] not in plugins]
    imported, failed, thread_starter = 0, [], []
    t0 = time.monotonic()
    with _Recorder() as rec:
        for i, name in order:
            while pending and pending[0][2] <= i:  # the engine wrote it before this import started
                key, value, _, _ = pending.pop(0)
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if name in sys.modules:
                continue
            try:
                __import__(name)
                imported += 1
                if threading.active_count() > 1 and not thread_starter:
                    thread_starter = [name, [t.name for t in threading.enumerate()]]
            except BaseException as exc:  # noqa: B036 - an optional dependency refuses to load on this CPU box
                # what it left in sys.modules stays, as it would after the engine's own first attempt
                failed.append(f"{name}: {exc!r}"[:300])
    replayed = {w[0] for w in replays}
    # what the imports themselves wrote: a check's process keeps it (the engine writes its own again)
    delta = {k: v for k, v in os.environ.items() if start_env.get(k) != v and k not in replayed}
    removed = sorted(k for k in start_env if k not in os.environ and k not in replayed)
    return {
        "imported": imported, "failed": failed, "seconds": round(time.monotonic() - t0, 2),
        "observed": sorted({k for k, _, c, scan in rec.reads if _seen(k, c, scan)} | set(replay_inputs)),
        "scans": sorted({c for _, c in rec.scans} | set(replay_scans)),
        "replayed": sorted(replayed), "delta": delta, "removed": removed,
        "modules": sorted(sys.modules), "threads": threading.active_count(), "thread_starter": thread_starter,
        # native pools (OpenBLAS starts its threads at numpy's import) stop and restart around fork themselves
        "native_threads": len(os.listdir("/proc/self/task")),
        "probe_errors": found.get("errors", []),
    }


def child(req: dict) -> None:
    """In the forked child: become what ``python -m pytest ARGS`` started in ``cwd`` with ``env`` would be."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (devnull, out, err):
        os.close(fd)
    REPLY.close()  # through its file object: nothing is left to flush or close at the child's exit
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if "numpy.random" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
        sys.modules["numpy.random"].seed()
    import runpy

    if req.get("script"):  # python SCRIPT ARGS: the script's folder first; it ends as a script ends
        script = req["script"]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        sys.argv = [script, *req["args"]]
        sys.orig_argv = [sys.orig_argv[0], script, *req["args"]]
        runpy.run_path(script, run_name="__main__")
        raise SystemExit(0)  # a script that returns: exit 0, threads joined and exit handlers run by the interpreter
    sys.path[0] = req["cwd"]  # python -m: the working directory first
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["-m", *req["args"]]
    sys.orig_argv = [sys.orig_argv[0], "-m", "pytest", *req["args"]]
    runpy._run_module_as_main("pytest")  # sets sys.argv[0] to pytest/__main__.py; raises SystemExit


def serve(ready: dict) -> None:
    _reply(op="ready", **ready)
    running = None
    buf = b""
    while True:
        if running is not None:
            done, status = os.waitpid(running, os.WNOHANG)
            if done:
                _reply(op="exit", pid=running, code=os.waitstatus_to_exitcode(status))
                running = None
        readable, _, _ = select.select([REQUESTS], [], [], 0.05 if running else None)
        if not readable:
            continue
        data = os.read(REQUESTS.fileno(), 1 << 20)
        if not data:  # the outer pytest is gone: so are we, and the check we run
            if running is not None:
                try:
                    os.killpg(running, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if running is not None:
                _reply(op="error", message="busy")
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    child(req)
                except SystemExit:
                    raise  # the interpreter exits as python -m pytest would
                except BaseException:  # noqa: B036 - the child must never return into the zygote's loop
                    if req.get("script"):
                        raise  # the interpreter prints it and exits 1, as it does for python SCRIPT
                    import traceback

                    traceback.print_exc()
                    os._exit(70)
                os._exit(0)
            running = pid
            _reply(op="started", pid=pid)


def main() -> None:
    sys.path[0] = CONFIG["cwd"]  # as python -m: the working directory, not this file's folder
    found = run_probe(CONFIG["entries"]) if CONFIG["entries"] else {}
    serve(preimport(found))


if __name__ == "__main__":
    main()
