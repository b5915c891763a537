"""PLE sidecar hooks on the real sglang 0.5.23 (CPU, TRITON_INTERPRET=1).

Runs inside the sglang venv. The hooks are installed through sglang's real ``load_plugins()``
(an entry point in group ``sglang.srt.plugins``). The reference is sglang's own offload path,
unhooked: the real ``Qwen4ExpNGramEmbedding`` with its file backend, filled by the real
``Qwen4ExpForConditionalGeneration.load_weights`` from real safetensors shards, gathered by the
real ``_gather_ple_embedding_from_pinned_kernel``. Ids come from the real ``_hash_contexts``.
Only the model object around the PLE module is a stand-in.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[3]
LAYER, PARTS, COLS = 3, 8, 160
ROWS = 16896  # padded vocabulary of ngram_vocab_size_base=1000, PLE index 0
EOS = 7
EP_TEXT = "[sglang.srt.plugins]\nssd_stream_ple_check = sglang_ssd_stream.sglang.hooks:install\n"


def _conftest():
    spec = importlib.util.spec_from_file_location("_sidecar_conftest", REPO / "tests/sidecar/conftest.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _uncached(monkeypatch):
    """This file proves the uncached readers (row cache budget 0); check_ple_row_cache.py the row cache."""
    monkeypatch.setenv("SGLANG_SSD_STREAM_ROW_CACHE_MB", "0")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Checkpoints + sidecars (fp8 and bf16), hooks installed through load_plugins()."""
    import sglang.srt.models.qwen4_exp as q
    import sglang.srt.models.qwen4_exp_ple_table as pt

    from sglang_ssd_stream.sidecar.build import build_sidecar

    originals = {"gather": q.Qwen4ExpPinnedHostEmbedding.gather, "alloc": pt.allocate_ple_host_table,
                 "load": q.Qwen4ExpForConditionalGeneration.load_weights,
                 "consume": q.Qwen4ExpPLELayer._consume_prefetched_embeddings}
    ep = tmp_path_factory.mktemp("ep") / "ssd_stream_ple_check-0.0.dist-info"
    ep.mkdir()
    (ep / "METADATA").write_text("Metadata-Version: 2.1\nName: ssd-stream-ple-check\nVersion: 0.0\n")
    (ep / "entry_points.txt").write_text(EP_TEXT)
    sys.path.insert(0, str(ep.parent))
    from sglang.srt.plugins import load_plugins

    load_plugins()
    cf = _conftest()
    root = tmp_path_factory.mktemp("ple")
    data = {}
    for dtype in ("float8_e4m3fn", "bfloat16"):
        ck = cf.make_checkpoint(root / f"ck-{dtype}", {LAYER: (dtype, ROWS, COLS)}, parts=PARTS, files=2, seed=11)
        build_sidecar(ck.path, root / f"sidecar-{dtype}", progress=False)
        data[dtype] = ck
    return types.SimpleNamespace(q=q, pt=pt, originals=originals, root=root, ck=data, cf=cf)


def _config(dtype: str, *, offload: bool = True, table_dir: str = "/nonexistent"):
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        hidden_size=2560, vocab_size=1000, ngram_vocab_size_base=1000, eos_token_id=EOS, split_ngram_parts=PARTS,
        ple_offload_embedding=offload, ple_offload_backend="file", ple_offload_dir=table_dir,
        ple_embedding_dtype="float8_e4m3fn" if dtype == "float8_e4m3fn" else None,
    )


def _tp(tp):
    r, n = tp
    return dict(tp_rank=r, tp_size=n, attn_tp_rank=r, attn_tp_size=n, moe_tp_rank=r, moe_tp_size=n)


class _Model(nn.Module):
    """Stand-in for Qwen4ExpForConditionalGeneration: just what its load_weights reads."""

    def __init__(self, q, cfg, tp):
        super().__init__()
        from sglang.srt.runtime_context import get_parallel

        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module() for _ in range(LAYER + 1)])
        with get_parallel().override(**_tp(tp)):
            self.model.layers[LAYER].ple = nn.Module()
            self.model.layers[LAYER].ple.ple_embedding = q.Qwen4ExpNGramEmbedding(cfg, cfg.ple_embed_dim,
                                                                                  ple_layer_index=0)
        self.config, self.start_layer, self.end_layer, self.language_model_only = cfg, 0, LAYER + 1, False
        self.pp_group = types.SimpleNamespace(is_last_rank=True, is_first_rank=True)
        self.tp = tp
        self._load_qwen4_exp_ple_buffer = types.MethodType(
            q.Qwen4ExpForConditionalGeneration._load_qwen4_exp_ple_buffer, self)

    @property
    def ngram(self):
        return self.model.layers[LAYER].ple.ple_embedding

    def load(self, q, ckpt: Path):
        from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
        from sglang.srt.runtime_context import get_parallel

        files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
        with get_parallel().override(**_tp(self.tp)):
            return q.Qwen4ExpForConditionalGeneration.load_weights(self, safetensors_weights_iterator(files))


def _ids(q, ngram, n_tokens: int, seed: int) -> torch.Tensor:
    """Row ids from the model's own hashing (the unfused path that runs on CPU)."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, 1000, size=(n_tokens, 3)))
    tokens[rng.random(n_tokens) < 0.1, 1] = EOS  # EOS resets the n-gram window
    q.get_req_to_token_pool = lambda: types.SimpleNamespace(ple_window_cache=None)
    ids = ngram._hash_contexts(tokens, decode_sized=False)
    assert ids.shape == (n_tokens, 16)
    return ids


def _gather(emb, ids):
    out = torch.empty((*ids.shape, emb.embedding_dim), dtype=torch.bfloat16)
    return emb.gather(ids, out=out)


def test_hooks_land_on_real_classes_after_load_plugins(env):
    q, pt, o = env.q, env.pt, env.originals
    from sglang_ssd_stream.sglang import hooks

    assert q.Qwen4ExpPinnedHostEmbedding.gather is not o["gather"]
    assert q.Qwen4ExpForConditionalGeneration.load_weights is not o["load"]
    assert q.Qwen4ExpPLELayer._consume_prefetched_embeddings is not o["consume"]
    assert pt.allocate_ple_host_table is not o["alloc"]
    assert q.allocate_ple_host_table is pt.allocate_ple_host_table  # the `from … import` copy qwen4_exp calls
    assert hooks.install() is True  # idempotent: a second install (e.g. from plugin.register) is harmless


@pytest.mark.parametrize("io", ["mmap", "pread"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("tp", [(0, 1), (0, 2), (1, 2)])
def test_lookup_bit_identical_to_sglang_offload_path(env, tmp_path, monkeypatch, dtype, tp, io):
    q = env.q
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    from sglang_ssd_stream.staging.gather import SidecarGather

    ck = env.ck[dtype]
    monkeypatch.delenv("SGLANG_SSD_STREAM_SIDECAR", raising=False)
    monkeypatch.setenv("SGLANG_SSD_STREAM_IO", io)
    ref = _Model(q, _config(dtype, table_dir=str(tmp_path / "tbl")), tp)
    ref_loaded = ref.load(q, ck.path)
    ids = _ids(q, ref.ngram, 96, seed=tp[0] * 10 + tp[1])
    ids[0, 0], ids[1, 0], ids[2, 0] = 0, ROWS - 1, ids[3, 0]  # first/last rows, a duplicate
    expected = _gather(ref.ngram.ngram_embedding, ids)

    artifact = env.root / f"sidecar-{dtype}"
    ours_cfg = _config(dtype, table_dir=str(tmp_path / "must-not-exist"))
    if tp == (0, 2):  # the model directory (--model-path) holds ssd-stream.json
        model_path = artifact
    else:  # or the variable names it
        monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(artifact / "ssd-stream.json"))
        model_path = ck.path
    with get_context().override_server_args():
        get_context().set_server_args(ServerArgs(model_path=str(model_path)))
        ours = _Model(q, ours_cfg, tp)
        emb = ours.ngram.ngram_embedding
        assert emb.weight.stride() == (0, 0) and tuple(emb.weight.shape) == (ROWS // tp[1], COLS)
        loaded = ours.load(q, ck.path)
        got = _gather(emb, ids)
    assert not (tmp_path / "must-not-exist").exists()  # no file-backend table was created
    assert isinstance(emb._ssd_stream, SidecarGather)
    assert type(emb._ssd_stream.reader).__name__ == {"mmap": "MappedReader", "pread": "SidecarReader"}[io]
    # the shards never reached sglang's loader; the scale did
    assert f"model.layers.{LAYER}.ple.ple_embedding.ngram_embedding.weight" in ref_loaded
    assert f"model.layers.{LAYER}.ple.ple_embedding.ngram_embedding.weight" not in loaded
    assert f"model.layers.{LAYER}.ple.ple_embedding.ngram_embedding.weight_scale" in loaded
    assert torch.equal(emb.weight_scale, ref.ngram.ngram_embedding.weight_scale)
    assert emb.weight_scale.item() == ck.scales[LAYER]

    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # bit for bit
    # and against the shard bytes themselves, independent of sglang's loader
    lo, hi = emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index
    flat = ids.reshape(-1).numpy()
    inr = (flat >= lo) & (flat < hi)
    raw = torch.from_numpy(np.ascontiguousarray(ck.tables[LAYER][np.where(inr, flat, 0)]))
    from_shards = raw.view(torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.bfloat16).to(torch.bfloat16)
    from_shards[torch.from_numpy(~inr)] = 0
    g = got.reshape(-1, COLS)
    nan = from_shards.isnan()  # NaN encodings: torch and the Triton interpreter convert them differently
    assert torch.equal(g.view(torch.int16)[~nan], from_shards.view(torch.int16)[~nan])
    assert (~inr).any() == (tp[1] > 1) and not got.reshape(-1, COLS)[torch.from_numpy(~inr)].any()


def test_refuses_without_ple_offload(env, monkeypatch):
    from sglang_ssd_stream.sglang.hooks import SidecarHookError

    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(env.root / "sidecar-float8_e4m3fn"))
    m = _Model(env.q, _config("float8_e4m3fn", offload=False), (0, 1))
    with pytest.raises(SidecarHookError, match="--ple-offload-embedding"):
        m.load(env.q, env.ck["float8_e4m3fn"].path)


def test_refuses_dtype_mismatch_with_model_config(env, monkeypatch):
    from sglang_ssd_stream.sidecar.errors import SidecarShapeMismatch

    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(env.root / "sidecar-bfloat16"))
    m = _Model(env.q, _config("float8_e4m3fn"), (0, 1))
    with pytest.raises(SidecarShapeMismatch, match="is bfloat16, but the model expects float8_e4m3fn"):
        m.load(env.q, env.ck["float8_e4m3fn"].path)


def test_refuses_a_checkpoint_scale_that_disagrees_with_the_sidecar(env, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import save_file

    from sglang_ssd_stream.sglang.hooks import SidecarHookError

    art = tmp_path / "art"
    shutil.copytree(env.root / "sidecar-float8_e4m3fn", art)
    name = f"model.language_model.layers.{LAYER}.ple.ple_embedding.ngram_embedding.weight_scale"
    save_file({name: torch.tensor([0.5], dtype=torch.bfloat16)}, str(art / "model-plefp8-scale.safetensors"))
    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(art))
    m = _Model(env.q, _config("float8_e4m3fn"), (0, 1))
    with pytest.raises(SidecarHookError, match="weight_scale .* differs from the sidecar's 0.5"):
        m.load(env.q, env.ck["float8_e4m3fn"].path)


def test_refuses_a_sidecar_with_a_wrong_sha256(env, tmp_path, monkeypatch):
    import shutil

    from sglang_ssd_stream.sidecar.errors import SidecarChecksumMismatch

    art = tmp_path / "art"
    shutil.copytree(env.root / "sidecar-float8_e4m3fn", art)
    table = next((art / "ple").iterdir())
    with open(table, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 1]))
    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(art))
    with pytest.raises(SidecarChecksumMismatch):
        _Model(env.q, _config("float8_e4m3fn"), (0, 1))


@pytest.mark.parametrize("tp,shards", [((0, 1), PARTS), ((0, 2), PARTS // 2), ((1, 2), PARTS // 2)])
def test_every_overlapping_checkpoint_shard_is_spot_checked(env, monkeypatch, tp, shards):
    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(env.root / "sidecar-float8_e4m3fn"))
    m = _Model(env.q, _config("float8_e4m3fn"), tp)
    m.load(env.q, env.ck["float8_e4m3fn"].path)
    assert m._ssd_stream_spot_checks == shards  # one random row of each shard this rank holds


@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_a_self_consistent_sidecar_of_another_checkpoint_is_refused_at_load(env, tmp_path, monkeypatch, tp):
    """Every byte of the table changed and its SHA-256 updated in the manifest: the hash check passes,
    the comparison with the checkpoint's own shards does not (issue 29 item 8)."""
    import hashlib
    import json
    import shutil

    from sglang_ssd_stream.sidecar.errors import SidecarChecksumMismatch

    art = tmp_path / "other"
    shutil.copytree(env.root / "sidecar-float8_e4m3fn", art)
    for cache in art.glob(".ssd-stream-verified*"):
        cache.unlink()
    doc = json.loads((art / "ssd-stream.json").read_text())
    for t in doc["tables"]:
        f = art / t["path"]
        data = bytes(b ^ 0x01 for b in f.read_bytes())
        f.write_bytes(data)
        t["sha256"] = hashlib.sha256(data).hexdigest()
    (art / "ssd-stream.json").write_text(json.dumps(doc))
    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(art))
    m = _Model(env.q, _config("float8_e4m3fn"), tp)  # binds: the sidecar is consistent with itself
    with pytest.raises(SidecarChecksumMismatch, match="built from another checkpoint"):
        m.load(env.q, env.ck["float8_e4m3fn"].path)


def test_gather_on_an_unbound_sidecar_table_refuses(env, monkeypatch):
    from sglang_ssd_stream.sglang.hooks import SidecarHookError

    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(env.root / "sidecar-float8_e4m3fn"))
    m = _Model(env.q, _config("float8_e4m3fn"), (0, 1))
    with pytest.raises(SidecarHookError, match="never bound"):
        _gather(m.ngram.ngram_embedding, torch.zeros((2, 16), dtype=torch.long))


REWRITE = "written while it is served"


@pytest.mark.parametrize("io,error,message", [("pread", "SidecarTruncated", "truncated: it has 4096 bytes"),
                                              ("mmap", "SidecarTruncated", "truncated: it has 4096 bytes"),
                                              ("pread", "SidecarChanged", REWRITE), ("mmap", "SidecarChanged", REWRITE),
                                              ("pread-nocache", "SidecarChanged", REWRITE),
                                              ("mmap-nocache", "SidecarChanged", REWRITE)])
def test_read_error_after_bind_fails_closed(env, tmp_path, monkeypatch, io, error, message):
    """The table shrinks, or is rewritten in place (same inode and size, `cp other/… a/…`; issue 29 item 6),
    under the running server: the next lookup refuses, with the row cache in front (default) and without."""
    import shutil
    import time

    from sglang_ssd_stream.sidecar import errors

    art = tmp_path / "art"
    shutil.copytree(env.root / "sidecar-float8_e4m3fn", art)
    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(art))
    monkeypatch.setenv("SGLANG_SSD_STREAM_IO", io.split("-")[0])
    if io.endswith("-nocache"):
        monkeypatch.setenv("SGLANG_SSD_STREAM_ROW_CACHE_MB", "0")
    m = _Model(env.q, _config("float8_e4m3fn"), (0, 1))
    m.load(env.q, env.ck["float8_e4m3fn"].path)
    ids = torch.full((4, 16), ROWS - 1, dtype=torch.long)
    table = next((art / "ple").iterdir())
    if error == "SidecarTruncated":
        os.truncate(table, 4096)  # the file shrinks under the running server
    else:
        _gather(m.ngram.ngram_embedding, ids)  # served (and cached) before the rewrite
        time.sleep(0.05)  # past the filesystem's timestamp granularity, as a served table's last write is
        with open(table, "r+b") as f:
            f.write(bytes(b ^ 0x5A for b in table.read_bytes()))
    with pytest.raises(getattr(errors, error), match=message):
        _gather(m.ngram.ngram_embedding, ids)
    with pytest.raises(errors.SidecarReaderUnusable):
        _gather(m.ngram.ngram_embedding, torch.zeros((1, 16), dtype=torch.long))


@pytest.mark.parametrize("name,value,message", [
    ("SGLANG_SSD_STREAM_IO", "aio", "SGLANG_SSD_STREAM_IO='aio': expected one of mmap, pread"),
    ("SGLANG_SSD_STREAM_PLE_GATHER", "zero-copy", "SGLANG_SSD_STREAM_PLE_GATHER='zero-copy': expected one of h2d, uva"),
    ("SGLANG_SSD_STREAM_READ_WORKERS", "0", "SGLANG_SSD_STREAM_READ_WORKERS=0 is out of range 1..256"),
    ("SGLANG_SSD_STREAM_READ_WORKERS", "100000", "SGLANG_SSD_STREAM_READ_WORKERS=100000 is out of range 1..256"),
    ("SGLANG_SSD_STREAM_PLE_MAX_TOKENS", str(10**30), "SGLANG_SSD_STREAM_PLE_MAX_TOKENS=" + str(10**30)
     + " is out of range 1..1048576"),
    pytest.param("SGLANG_SSD_STREAM_SWITCH_INTERVAL_US", "500",
                 "SGLANG_SSD_STREAM_SWITCH_INTERVAL_US is no longer used (reads captured in CUDA graphs are native "
                 "host nodes now and need no GIL); unset it", id="retired-switch-interval"),
])
def test_bad_knob_values_stop_the_plugin_at_start(monkeypatch, name, value, message):
    """A bad value (or a knob that no longer acts) is refused when the plugin registers, not at the first request."""
    from sglang_ssd_stream.sglang import plugin

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(SystemExit, match=re.escape(message)):
        plugin.register()


def test_gather_inside_graph_capture_is_captured_not_refused(env, monkeypatch):
    """During sglang's decode-graph capture the hook records the read into the graph
    (``SidecarGather.capture``: D2H, host node, conversion; run on the H200) and waits for nothing."""
    from sglang_ssd_stream.sglang import hooks
    from sglang_ssd_stream.staging.gather import SidecarGather

    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(env.root / "sidecar-float8_e4m3fn"))
    m = _Model(env.q, _config("float8_e4m3fn"), (0, 1))
    m.load(env.q, env.ck["float8_e4m3fn"].path)
    emb = m.ngram.ngram_embedding
    calls = []
    monkeypatch.setattr(hooks, "_capturing", lambda: True)
    monkeypatch.setattr(SidecarGather, "capture", lambda self, ids, out, stream: calls.append((ids, out, stream)))
    monkeypatch.setattr(SidecarGather, "begin", lambda *a, **k: pytest.fail("eager read inside capture"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: "capture-stream")
    ids = torch.randint(0, ROWS, (3, 16))
    out = torch.empty((3, 16, emb.embedding_dim), dtype=torch.bfloat16)
    got = emb.gather(ids, out)
    assert got is out and len(calls) == 1
    cids, cout, cstream = calls[0]
    assert torch.equal(cids, ids.reshape(-1)) and cout.data_ptr() == out.data_ptr()
    assert tuple(cout.shape) == (48, emb.embedding_dim) and cstream == "capture-stream"
    assert emb._ssd_stream._pending is None  # nothing left for the consumer to wait on


@pytest.mark.parametrize("io", ["mmap", "pread"])
@pytest.mark.parametrize("cc", ["working", "broken"])
def test_binding_for_cuda_graphs_needs_the_native_host_node_library(env, monkeypatch, tmp_path, io, cc):
    """With CUDA graphs on, reads are captured as native host nodes: binding the sidecar builds/loads
    that library for either reader, and a machine that cannot compile it stops the model load (the
    worker) with the way out named, instead of failing at the first capture."""
    from sglang_ssd_stream.staging import native_read

    monkeypatch.setattr(native_read, "_lib", None)
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(env.root / "sidecar-float8_e4m3fn"))
    monkeypatch.setenv("SGLANG_SSD_STREAM_IO", io)
    if cc == "broken":
        monkeypatch.setenv("CC", "false")
    m = _Model(env.q, _config("float8_e4m3fn"), (0, 1))
    if cc == "broken":
        with pytest.raises(native_read.NativeBuildError, match=r"(?s)compiling the native host-node library "
                                                               r"failed.*--disable-cuda-graph"):
            m.load(env.q, env.ck["float8_e4m3fn"].path)
        assert not native_read.library_path().exists()
        return
    m.load(env.q, env.ck["float8_e4m3fn"].path)
    assert native_read.library_path().is_file() and native_read._lib is not None
    assert m.ngram.ngram_embedding._ssd_stream.reader.io == io


def test_conversion_kernel_matches_sglang_kernel_for_every_byte(env):
    """Our staged-row kernel vs sglang's gather kernel, over all 256 fp8 bytes and random bf16."""
    from sglang_ssd_stream.staging.kernels import convert_staged_rows

    kernel = env.q._gather_ple_embedding_from_pinned_kernel
    rng = np.random.default_rng(3)
    for is_fp8, itemsize in ((True, 1), (False, 2)):
        rows = 37
        raw = rng.integers(0, 256, size=(rows, COLS * itemsize), dtype=np.uint8)
        if is_fp8:
            raw.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
        src = torch.from_numpy(raw)
        ours = torch.empty((rows, COLS), dtype=torch.bfloat16)
        convert_staged_rows(src, ours, is_fp8=is_fp8)
        theirs = torch.empty((rows, COLS), dtype=torch.bfloat16)
        kernel[(rows,)](src.data_ptr(), torch.arange(rows), theirs, embedding_dim=COLS, tp_vocab_start=0,
                        tp_vocab_end=rows, is_fp8=is_fp8, BLOCK_D=256)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


_BROKEN = {
    "missing_target": "import sglang.srt.models.qwen4_exp as q; del q.Qwen4ExpPLELayer._consume_prefetched_embeddings",
    "apply_fails": ("from sglang.srt.plugins.hook_registry import HookRegistry\n"
                    "def boom(*a, **k): raise RuntimeError('simulated apply failure')\n"
                    "HookRegistry._apply_target = classmethod(boom)"),
}


@pytest.mark.parametrize("how", sorted(_BROKEN))
def test_install_raises_when_a_hook_cannot_land(how):
    code = _BROKEN[how] + "\nfrom sglang_ssd_stream.sglang.hooks import install\ninstall()\nprint('INSTALLED')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0 and "INSTALLED" not in r.stdout
    want = "is missing in this sglang" if how == "missing_target" else "did not take effect"
    assert "SidecarHookError" in r.stderr and want in r.stderr, r.stderr[-2000:]
