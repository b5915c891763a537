"""Where a test suite's CPU goes, from a py-spy profile of the whole suite (every process it starts).

Record (one suite, on an otherwise idle box; py-spy follows the servers, engine checks and their children):

    py-spy record --subprocesses --nonblocking -r 20 -f raw -o SUITE.txt -- \\
        "$(pyenv which python3)" scripts/suites.py --durations 100 SUITE

then ``python3 benchmarks/ci/pyspy_summary.py SUITE.txt [--rate 20]``. Samples without a Python frame (native
threads waiting) are left out; what remains is CPU spent in Python code and the C it calls. It prints the samples'
seconds by activity (imports, Triton's interpreter, Triton's compiler, pip, hashing, the rest), by the top-level
package being imported, by process (command line, shortened) and by innermost frame.
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Iterator

_COUNT = re.compile(r" (\d+)$")


def records(path: str) -> Iterator[tuple[list[str], list[str], int]]:
    """(process frames, Python frames, samples) per stack; a command line may hold newlines, so a record ends
    only at a line that ends with its count."""
    buf = ""
    with open(path, errors="replace") as f:
        for raw in f:
            buf += raw.rstrip("\n")
            m = _COUNT.search(buf)
            if not m:
                buf += " "
                continue
            stack, n = buf[:m.start()], int(m.group(1))
            buf = ""
            frames = stack.split(";")
            procs = [f for f in frames if f.startswith("process ")]
            yield procs, [f for f in frames if not f.startswith("process ")], n


def activity(frames: list[str]) -> tuple[str, str | None]:
    for i, f in enumerate(frames):
        if f.startswith("_find_and_load"):
            for g in frames[i:]:
                m = re.match(r"<module> \(([^:<][^:]*):", g)
                if m:
                    return "import", m.group(1).split("/")[0]
            return "import", None
    stack = ";".join(frames)
    for needle, name in (("triton/runtime/interpreter.py", "triton interpreter"),
                         ("triton/compiler", "triton compiler"), ("triton/backends", "triton compiler"),
                         ("pip/_internal", "pip"), ("hashlib", "hashing"), ("create_default_context (ssl.py", "TLS")):
        if needle in stack:
            return name, None
    return "other", None


def command(procs: list[str]) -> str:
    if not procs:
        return "?"
    cmd = procs[-1].split(":", 1)[1] if ":" in procs[-1] else procs[-1]
    cmd = re.sub(r"\S*/bin/python\S*", "PY", cmd)
    cmd = re.sub(r"/tmp/\S+|run-\w+", "…", cmd)
    cmd = re.sub(r"--junitxml=\S+", "", cmd)
    if "multiprocessing.spawn" in cmd or "--multiprocessing-fork" in cmd:
        return "a spawned child (multiprocessing)"
    return " ".join(cmd.split())[:110]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--rate", type=float, default=20.0, help="py-spy's samples per second (-r)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    acts, pkgs, cmds, leaves = (collections.Counter() for _ in range(4))
    total = 0
    for procs, frames, n in records(args.profile):
        if not frames:
            continue
        total += n
        act, pkg = activity(frames)
        acts[act] += n
        if pkg:
            pkgs[pkg] += n
        cmds[command(procs)] += n
        leaves[frames[-1][:110]] += n
    print(f"samples with a Python frame: {total / args.rate:.0f} s")
    sections = (("activity", acts), ("imported package", pkgs), ("process", cmds), ("innermost frame", leaves))
    for title, counter in sections:
        print(f"== {title}")
        for key, n in counter.most_common(args.top):
            print(f"{n / args.rate:8.0f} s {100 * n / total:5.1f} %  {key}")


if __name__ == "__main__":
    main()
