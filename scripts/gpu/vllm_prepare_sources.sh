#!/bin/sh
# Copy the vLLM 0.33.0 files the vllm_* GPU scripts need into .gpu/vllm-src (git-ignored; pass it
# as `carry`), and write the patched QSA kernel module by applying patches/vllm/0001 with the kit's
# own engine (both hash-checked against hashes/vllm-0.33.0.json). Run on the CPU machine:
#   scripts/gpu/vllm_prepare_sources.sh [vllm-python [sglang-python]]   (default: the cached venvs)
# sglang's vocab_parallel_embedding.py comes along for the SGLang side of vllm_tp2_ple_h200x2.py, and a
# static fio (scripts/gpu/build_static_fio.sh) for the disk numbers (`--fio .gpu/vllm-src/fio`).
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=${1:-$("$repo/scripts/engine-venv.sh" vllm)}
out="$repo/.gpu/vllm-src"
mkdir -p "$out"
site=$("$py" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("vllm").origin).parent.parent)')
cp "$site/vllm/models/qwen4_exp/common/ngram_embedding.py" "$out/ngram_embedding.py"
cp "$site/vllm/models/qwen4_exp/nvidia/ops/qsa.py" "$out/qsa.pristine.py"
cp "$site/vllm/model_executor/layers/vocab_parallel_embedding.py" "$out/vocab_parallel_embedding.py"
cp "$site/vllm/model_executor/warmup/jit_warmup_triton_helper.py" "$out/jit_warmup_triton_helper.py"
sg_py=${2:-$("$repo/scripts/engine-venv.sh" sglang)}
sg_site=$("$sg_py" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent)')
cp "$sg_site/sglang/srt/layers/vocab_parallel_embedding.py" "$out/sglang_vocab_parallel_embedding.py"
PYTHONPATH="$repo" "$py" - "$out" "$repo" <<'PY'
import hashlib, json, sys
from pathlib import Path
from sglang_ssd_stream.patching.diff import apply_file, load_patch
out = Path(sys.argv[1])
rel = "vllm/models/qwen4_exp/nvidia/ops/qsa.py"
patch = load_patch(Path(sys.argv[2]) / "patches/vllm/0001-qsa-quantized-tile-smem-guard.patch", "0001")
pristine = (out / "qsa.pristine.py").read_bytes()
patched, _ = apply_file(pristine, patch.files[rel], path=rel)
entry = next(f for f in json.loads((Path(sys.argv[2]) / "hashes/vllm-0.33.0.json").read_text())["files"] if f["path"] == rel)
for state, data in (("pristine", pristine), ("patched", patched)):
    if hashlib.sha256(data).hexdigest() != entry[state]:
        sys.exit(f"qsa.{state}.py does not have the manifest's {state} SHA-256 {entry[state]}")
(out / "qsa.patched.py").write_bytes(patched)
info = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in sorted(p.name for p in out.glob("*.py"))}
(out / "SOURCES.json").write_text(json.dumps(info, indent=1))
print(json.dumps(info, indent=1))
PY
"$repo/scripts/gpu/build_static_fio.sh" "$out/fio"
echo "wrote $out"
