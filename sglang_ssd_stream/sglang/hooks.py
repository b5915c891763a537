"""HookRegistry hooks that serve sglang 0.5.23's offloaded PLE table from the sidecar.

sglang's own path stays in charge: the model's hashing (``Qwen4ExpNGramEmbedding``), its
prefetch boundary (``Qwen4ExpPLELayer.start_prefetch`` for layer i+1 while layer i runs, on its
side stream), its output buffers, TP reduce and ``weight_scale`` multiply. Four AROUND hooks
change only where rows come from:

=============================================================  ==========================================
target                                                         hook
=============================================================  ==========================================
``qwen4_exp_ple_table.allocate_ple_host_table``                no 47 GiB pinned table: a 1-element
                                                               placeholder of the right shape/dtype
``qwen4_exp.Qwen4ExpForConditionalGeneration.load_weights``    bind each PLE embedding to its sidecar
                                                               table (shape/dtype/TP range checked), drop
                                                               ``.ngram_embedding.shard_`` tensors, set
                                                               ``weight_scale`` from the sidecar
``qwen4_exp.Qwen4ExpPinnedHostEmbedding.gather``               start the staged sidecar gather
                                                               (:class:`..staging.SidecarGather`)
``qwen4_exp.Qwen4ExpPLELayer._consume_prefetched_embeddings``  wait until the gather's GPU work is
                                                               enqueued before sglang waits on the stream
=============================================================  ==========================================

Rows come through a :class:`~..sidecar.row_cache.RowCache` per layer unless ``SGLANG_SSD_STREAM_ROW_CACHE_MB=0``
(:func:`bind_embeddings`), and five more AROUND hooks, in the scheduler (:mod:`.prefetch`:
``Scheduler._add_request_to_queue``, ``NgramEmbeddingManager.prepare_for_forward`` and
``mem_cache.common.release_kv_cache``; with MTP, ``EagleDraftWorker.draft`` and ``EAGLEWorkerV2.verify``), feed
the prefetch that ``load_weights`` starts over those caches: prompt chunks ahead, and a verify step's rows as
soon as its draft tokens exist.

The hooks are inert for a model without a sidecar (``config.active()`` is None). They are fatal
on failure: :func:`install` resolves every target first, applies the hooks and checks they took
effect, and raises otherwise (sglang's ``apply_hooks`` would only log).

The plugin does not call :func:`install` itself: resolving the targets imports ``qwen4_exp``, which
another model's server neither needs nor may be able to import (sglang's CPU engine cannot, without
the CPU build of sgl-kernel). :func:`install_for_served_model` puts one AROUND hook on sglang's
``get_model_architecture`` instead, the call every model load (target and draft) makes before it
builds the model: when the class it resolves is sglang's qwen4_exp, the PLE hooks are installed
there, before the model exists, and a failure stops that load; any other model is left alone. A
qwen4_exp checkpoint that sglang would serve with some other class is refused (the hooks would
never run).
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
import re

from . import config

log = logging.getLogger(__name__)

_M = "sglang.srt.models.qwen4_exp"
RESOLVE = "sglang.srt.model_loader.utils.get_model_architecture"  # (model_config) -> (model class, arch)
ALLOCATE = "sglang.srt.models.qwen4_exp_ple_table.allocate_ple_host_table"
LOAD_WEIGHTS = f"{_M}.Qwen4ExpForConditionalGeneration.load_weights"
GATHER = f"{_M}.Qwen4ExpPinnedHostEmbedding.gather"
CONSUME = f"{_M}.Qwen4ExpPLELayer._consume_prefetched_embeddings"

PLE_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.ple\.ple_embedding$")
PLE_SHARD = ".ngram_embedding.shard_"
SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.weight_scale$")

_installed = False
_gate_installed = False
_placeholders: set[int] = set()  # data_ptr of placeholder tables we handed out
_reported: set[str] = set()  # hooks that said they ran (once per process; gather/consume are hot)


def _ran(hook: str, message: str, *args) -> None:
    """``PLE sidecar hook <name> ran: ...`` in the engine's log, the first time ``hook`` serves."""
    if hook not in _reported:
        _reported.add(hook)
        log.info("PLE sidecar hook %s ran: " + message, hook, *args)


class SidecarHookError(RuntimeError):
    """The sidecar cannot serve this model as configured."""


# ----------------------------------------------------------------------------- install


def _hooks():
    from . import prefetch

    return ((ALLOCATE, around_allocate), (LOAD_WEIGHTS, around_load_weights), (GATHER, around_gather),
            (CONSUME, around_consume), (prefetch.PREPARE, prefetch.around_prepare_for_forward),
            (prefetch.RELEASE, prefetch.around_release_kv_cache),
            (prefetch.ARRIVE, prefetch.around_add_request_to_queue), (prefetch.DRAFT, prefetch.around_draft),
            (prefetch.VERIFY, prefetch.around_verify))


def _stale_bindings(original) -> list[str]:
    """Modules that still bind ``original`` after the hook replaced it (a ``from … import`` copy the
    registry's propagation missed): the hook would not run for their callers."""
    import sys
    import types

    stale = []
    for name, mod in list(sys.modules.items()):
        if isinstance(mod, types.ModuleType):
            try:
                if any(v is original for v in vars(mod).values()):
                    stale.append(name)
            except TypeError:
                continue
    return stale


def install() -> bool:
    """Register and apply the PLE sidecar hooks; returns False only when
    ``SGLANG_SSD_STREAM_SIDECAR=off``. Raises when a target is missing or a hook did not land."""
    global _installed
    if config.disabled():
        return False
    config.validate_env()
    if _installed:
        return True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    # also when called outside load_plugins
    source = HookSource(plugin_name="ssd_stream", dist_name="sglang-ssd-stream")
    originals = {}
    for target, _ in _hooks():
        try:
            originals[target] = pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as exc:
            raise SidecarHookError(f"PLE sidecar hook target {target} is missing in this sglang ({exc})") from exc
        if not callable(originals[target]):
            raise SidecarHookError(f"PLE sidecar hook target {target} is not callable")
    for target, hook in _hooks():
        HookRegistry.register(target, hook, HookType.AROUND, source=source)
    HookRegistry.apply_hooks()  # idempotent; load_plugins() calls it again
    import importlib

    bound = importlib.import_module(_M).allocate_ple_host_table  # the copy qwen4_exp actually calls
    for target, _ in _hooks():
        now = pkgutil.resolve_name(target)
        if now is originals[target]:
            raise SidecarHookError(f"PLE sidecar hook on {target} did not take effect (see the log above)")
    if bound is originals[ALLOCATE]:
        raise SidecarHookError(f"{_M}.allocate_ple_host_table still points at the original; hook not propagated")
    from .prefetch import RELEASE

    stale = _stale_bindings(originals[RELEASE])  # the scheduler calls its `from … import` copy
    if stale:
        raise SidecarHookError(f"{', '.join(stale)} still bind the original {RELEASE}; hook not propagated")
    _installed = True
    return True


def install_for_served_model() -> bool:
    """Arrange for :func:`install` to run when sglang resolves a qwen4_exp model class, and only then.

    Returns False only when ``SGLANG_SSD_STREAM_SIDECAR=off``. Knob values are checked now (a bad one
    stops the process at start); raises when the gate itself cannot land."""
    global _gate_installed
    if config.disabled():
        return False
    config.validate_env()
    if _gate_installed:
        return True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        original = pkgutil.resolve_name(RESOLVE)
    except (ImportError, AttributeError) as exc:
        raise SidecarHookError(f"hook target {RESOLVE} is missing in this sglang ({exc})") from exc
    HookRegistry.register(RESOLVE, around_get_model_architecture, HookType.AROUND)
    HookRegistry.apply_hooks()
    if pkgutil.resolve_name(RESOLVE) is original:
        raise SidecarHookError(f"hook on {RESOLVE} did not take effect (see the log above)")
    _gate_installed = True
    return True


def serves_qwen4_exp(model_class) -> bool:
    return getattr(model_class, "__module__", "").startswith(_M)  # qwen4_exp and qwen4_exp_mtp


def _qwen4_exp_checkpoint(model_config) -> bool:
    hf = getattr(model_config, "hf_config", None)
    kinds = [getattr(hf, "model_type", None) or "", *(getattr(hf, "architectures", None) or [])]
    return any(k.lower().replace("_", "").startswith("qwen4exp") for k in kinds)


def around_get_model_architecture(original, model_config, *args, **kwargs):
    resolved = original(model_config, *args, **kwargs)
    model_class = resolved[0]
    if serves_qwen4_exp(model_class):
        if not _installed:
            install()
            log.info("PLE sidecar hooks installed for %s", model_class.__name__)
    elif _qwen4_exp_checkpoint(model_config):
        raise SidecarHookError(
            f"{getattr(model_config, 'model_path', 'this model')} is a qwen4_exp checkpoint, but sglang resolved it "
            f"to {model_class.__module__}.{model_class.__name__}, not to {_M}: the PLE hooks would never run "
            f"(did {_M} fail to import? see the log above)")
    return resolved


# ----------------------------------------------------------------------------- hooks


def around_allocate(original, *args, **kwargs):
    sidecar = config.active()
    if sidecar is None:
        return original(*args, **kwargs)
    import torch

    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    shape, dtype = tuple(int(d) for d in bound.arguments["shape"]), bound.arguments["dtype"]
    # The rows live in the sidecar; sglang only needs a tensor of this shape and dtype.
    # One element expanded: any write through it fails instead of silently landing.
    table = torch.empty((1,) * len(shape), dtype=dtype).expand(*shape)
    _placeholders.add(table.data_ptr())
    log.info("PLE table %s %s (%s) served from sidecar %s", list(shape), dtype, bound.arguments.get("tag"),
             sidecar.manifest.path)
    _ran("allocate", "no host table allocated, rows come from %s", sidecar.manifest.path)
    return table


def _is_placeholder(weight) -> bool:
    return weight.data_ptr() in _placeholders and weight.stride() == (0,) * weight.dim()


def _row_cache_allocator(device, layer: int):
    """Row storage for one layer's cache: CUDA-registered host memory (a kernel reads the staged rows it
    copies out; the accounting line names it), plain memory on a CPU-only process."""
    if device.type != "cuda":
        return None
    from ..staging.host_memory import allocate_registered

    return lambda nbytes: allocate_registered(nbytes, label=f"PLE layer {layer} row cache")


def _layer_budget(reader, share: int) -> int:
    """``share`` bytes, or less when this rank's rows fit in less (a small table is held whole, never padded)."""
    from ..sidecar import row_cache

    local = reader.vocab_end - reader.vocab_start
    whole = (local * reader.row_bytes + row_cache.metadata_bytes(local)
             + row_cache.fixed_bytes(row_cache.DEFAULT_WAVE_PAGES, int(getattr(reader, "max_rows", 0))))
    return min(int(share), whole)


def _min_budget_mb(reader, layers: int) -> int:
    """The smallest budget (MiB, all layers) whose share holds one row per layer."""
    from ..sidecar import row_cache

    one = (reader.row_bytes + row_cache.metadata_bytes(1)
           + row_cache.fixed_bytes(row_cache.DEFAULT_WAVE_PAGES, int(getattr(reader, "max_rows", 0))))
    return -(-one * layers // (1 << 20))


def wrap_in_row_cache(reader, *, layer: int, share: int, layers: int, budget_mb: int, device):
    """``reader`` behind a :class:`~..sidecar.row_cache.RowCache` of this layer's share of the budget.

    Fatal on failure: a budget that holds no row, a library that cannot be built, memory that cannot be
    registered stop the model load with a :class:`SidecarHookError` naming the way out (never a silent
    fallback to the uncached reader)."""
    from ..sidecar.row_cache import RowCache

    try:
        cache = RowCache.for_budget(reader, _layer_budget(reader, share), allocate=_row_cache_allocator(device, layer))
    except Exception as exc:
        reader.close()
        raise SidecarHookError(f"PLE layer {layer}: cannot build the row cache ({config.ROW_CACHE_ENV}={budget_mb} "
                               f"MiB over {layers} layer(s)): {type(exc).__name__}: {exc}; set "
                               f"{config.ROW_CACHE_ENV}=0 to serve with the uncached reader") from exc
    if cache is None:
        reader.close()
        raise SidecarHookError(
            f"{config.ROW_CACHE_ENV}={budget_mb} MiB split over {layers} PLE layer(s) is {share / 2**20:.1f} MiB per "
            f"layer, which holds no {reader.row_bytes}-byte row after the cache's fixed read buffers; set at least "
            f"{_min_budget_mb(reader, layers)} MiB, or 0 to serve without the row cache")
    if device.type == "cuda":
        import torch

        from ..staging.host_memory import account, startup_line

        snap = account(cache_bytes=cache.working_set_bytes)
        log.info("%s", startup_line(f"layer {layer} row cache", cache.working_set_bytes,
                                    f"row cache ({cache.capacity} rows x {cache.row_bytes} B registered, + metadata "
                                    f"and read buffers)", snap, torch.cuda.get_device_properties(device).is_integrated))
    return cache


def bind_embeddings(model, sidecar: config.Sidecar) -> dict[int, object]:
    """Attach a :class:`SidecarGather` to every PLE embedding of ``model``; returns {layer: embedding}.

    With a row cache budget (``SGLANG_SSD_STREAM_ROW_CACHE_MB`` > 0, the default) each layer's reader is
    wrapped in a :class:`~..sidecar.row_cache.RowCache` of an even share of the budget, and captured reads
    (CUDA graphs) are the cache's own native host node; budget 0 serves from the mapped/pread reader."""
    import torch
    from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding, Qwen4ExpPinnedHostEmbedding

    from ..sidecar import open_reader
    from ..sidecar.format import check_model_shape
    from ..sidecar.reader import rows_for_tokens
    from ..sidecar.row_cache import captured_read
    from ..staging.gather import SidecarGather
    from ..staging.host_memory import fmt_bytes

    rows = rows_for_tokens(config.max_tokens())
    workers = config.read_workers()
    mode, io = config.gather_mode(), config.io_mode()
    budget_mb = config.row_cache_mb()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    found = []
    for name, mod in model.named_modules():
        if not isinstance(mod, Qwen4ExpNGramEmbedding):
            continue
        m = PLE_MODULE.search(name)
        if m is None:
            raise SidecarHookError(f"cannot tell the decoder layer of PLE module {name!r}")
        emb = mod.ngram_embedding
        if not isinstance(emb, Qwen4ExpPinnedHostEmbedding) or not _is_placeholder(emb.weight):
            raise SidecarHookError(
                f"{name}: the PLE sidecar needs sglang's offloaded PLE table (--ple-offload-embedding); "
                f"this embedding is a {type(emb).__name__} on {emb.weight.device}")
        found.append((int(m.group(1)), emb))
    share = (budget_mb << 20) // max(len(found), 1)
    bound = {}
    for layer, emb in found:
        table = sidecar.manifest.table(layer)
        lo, hi = emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index
        check_model_shape(table, dtype=str(emb.weight.dtype), columns=emb.embedding_dim, rows=emb.org_vocab_size,
                          row_range=(lo, hi))
        reader = open_reader(table, io, vocab_start=lo, vocab_end=hi, max_rows=rows, workers=workers)
        host_read = None
        if budget_mb:
            reader = wrap_in_row_cache(reader, layer=layer, share=share, layers=len(found), budget_mb=budget_mb,
                                       device=device)
            host_read = captured_read  # graph replays read through the cache's native host node
        emb._ssd_stream = SidecarGather(reader, columns=emb.embedding_dim,
                                        is_fp8=emb.weight.dtype == torch.float8_e4m3fn, capacity_rows=rows,
                                        device=device, mode=mode, graph_rows=rows if config.graphs_enabled() else 0,
                                        host_read=host_read,
                                        capacity_hint=f"; raise {config.MAX_TOKENS_ENV} or lower the chunk size")
        emb._ssd_stream_layer = layer
        bound[layer] = emb
        if budget_mb:
            log.info("PLE layer %d: sidecar %s rows [%d, %d), row cache %s (%d rows, %s, %s misses, %d workers), "
                     "%s, working set %.1f MiB", layer, table.file, lo, hi, fmt_bytes(reader.working_set_bytes),
                     reader.capacity, reader.policy, "O_DIRECT" if reader.direct else "buffered+dropped",
                     reader.workers, mode, emb._ssd_stream.working_set_bytes / 2**20)
        else:
            log.info("PLE layer %d: sidecar %s rows [%d, %d), %s reads x %d, %s, working set %.1f MiB", layer,
                     table.file, lo, hi, io, workers, mode, emb._ssd_stream.working_set_bytes / 2**20)
    if not bound:
        raise SidecarHookError(f"a PLE sidecar is configured ({sidecar.manifest.path}) but the model has no PLE layer")
    log.info("%s", memory_line(bound, budget_mb))
    if any(e._ssd_stream.graph_rows for e in bound.values()):
        if budget_mb:
            from ..sidecar.native import library_path as native_library
            from ..sidecar.row_cache import LIB_NAME, SOURCE

            library = native_library(SOURCE, LIB_NAME)
        else:
            from ..staging.native_read import library_path as native_read_library

            library = native_read_library()
        log.info("PLE sidecar under CUDA graphs: reads captured as native host nodes (%s)", library)
    return bound


def ple_rank_rows(rows: int, rank: int, size: int, config=None) -> tuple[int, int]:
    """``sidecar profile``'s TP split (:data:`..sidecar.profile.ShardRule`): TP rank ``rank``'s rows of a PLE table
    of ``rows`` rows, the ``shard_indices`` :func:`bind_embeddings` binds. Computed by sglang's own
    ``VocabParallelEmbedding`` constructor as ``Qwen4ExpNGramEmbedding`` calls it (the default padding, made a
    multiple of the TP size when the table does not divide), on the meta device, the rank and size set through
    sglang's own ``get_parallel().override``. ``config``: unused (sglang pads the PLE tables by its default)."""
    import torch
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=rank, tp_size=size), torch.device("meta"):
        emb = VocabParallelEmbedding(rows, 1, params_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    return emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index


def memory_line(bound: dict, budget_mb: int) -> str:
    """What the PLE layers of this process hold in host memory: the row caches and the staging."""
    from ..staging.host_memory import fmt_bytes

    gathers = [e._ssd_stream for e in bound.values()]
    staging = sum(g.pinned_bytes for g in gathers)
    if not budget_mb:
        return (f"PLE host memory: row cache off ({config.ROW_CACHE_ENV}=0), staging {fmt_bytes(staging)} for "
                f"{len(gathers)} layer(s); rows read through {gathers[0].reader.io}")
    cache = sum(g.reader.working_set_bytes for g in gathers)
    return (f"PLE host memory: row cache {fmt_bytes(cache)} ({sum(g.reader.capacity for g in gathers)} rows; "
            f"{config.ROW_CACHE_ENV}={budget_mb} MiB for {len(gathers)} layer(s)) + staging {fmt_bytes(staging)} = "
            f"{fmt_bytes(cache + staging)}")


SHARD_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")


class _Filter:
    """Drops PLE shard tensors from the checkpoint stream, after comparing one row of each shard that
    overlaps this rank with the sidecar (a row drawn at random inside the overlap, placed as sglang's
    ``load_qwen4_exp_ple_shard`` places it): a sidecar built from another checkpoint, or whose tables were
    swapped with their hashes, is refused before it serves. Records which scales the stream carried."""

    def __init__(self, weights, bound: dict | None = None, parts: int = 1):
        self.weights, self.dropped, self.scales_seen = weights, 0, set()
        self.bound, self.parts, self.checked = bound or {}, max(int(parts), 1), 0

    def __iter__(self):
        for name, tensor in self.weights:
            if PLE_SHARD in name and "mtp" not in name:
                self.dropped += 1
                self._spot_check(name, tensor)
                continue
            m = SCALE_NAME.search(name)
            if m and "mtp" not in name:
                self.scales_seen.add(int(m.group(1)))
            yield name, tensor

    def _spot_check(self, name: str, tensor) -> None:
        import secrets

        import numpy as np
        import torch

        m = SHARD_NAME.search(name)
        emb = self.bound.get(int(m.group(1))) if m else None
        if emb is None:
            return
        size = (emb.org_vocab_size + self.parts - 1) // self.parts
        start = int(m.group(2)) * size
        lo, hi = emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index
        a, b = max(start, lo), min(start + tensor.shape[0], hi)
        if a >= b:
            return  # another rank's rows
        row = a + secrets.randbelow(b - a)
        want = tensor[row - start].to(emb.weight.dtype).contiguous().view(-1).view(torch.uint8).numpy()
        from ..sidecar.row_cache import RowCache

        reader = emb._ssd_stream.reader
        if isinstance(reader, RowCache):
            reader = reader.reader  # the file's own reader: a check must not fill the cache or count in it
        got = np.empty((1, reader.row_bytes), np.uint8)
        reader.read_rows(np.array([row], np.int64), got)
        if not np.array_equal(got[0], want):
            from ..sidecar.errors import SidecarChecksumMismatch

            table = reader.table
            raise SidecarChecksumMismatch(
                f"PLE layer {m.group(1)}: sidecar {table.file} row {row} differs from checkpoint shard {name} "
                f"(rows {start}..{start + tensor.shape[0] - 1}): the sidecar was built from another checkpoint "
                f"(or its tables were swapped); rebuild it with `sglang-ssd-stream sidecar build`",
                path=str(table.file), actual=row, expected="identical bytes")
        self.checked += 1


def apply_scales(bound: dict, sidecar: config.Sidecar, seen: set[int]) -> None:
    import torch

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    for layer, emb in bound.items():
        ws = sidecar.scales.get(layer)
        if ws is None:
            if layer not in seen and emb.weight.dtype == torch.float8_e4m3fn:
                raise SidecarHookError(
                    f"PLE layer {layer}: no weight_scale in the sidecar ({sidecar.manifest.root}) nor in the "
                    f"checkpoint; an fp8 table without its scale would be served unscaled")
            continue
        value = torch.frombuffer(bytearray(ws.raw), dtype=dtypes[ws.dtype]).reshape(emb.weight_scale.shape)
        value = value.to(device=emb.weight_scale.device, dtype=emb.weight_scale.dtype)
        if layer in seen and not torch.equal(emb.weight_scale, value):
            raise SidecarHookError(
                f"PLE layer {layer}: the checkpoint's weight_scale {emb.weight_scale.item()} differs from the "
                f"sidecar's {value.item()} ({ws.file})")
        emb.weight_scale.copy_(value)


def around_load_weights(original, self, weights, *args, **kwargs):
    sidecar = config.active()
    if sidecar is None:
        return original(self, weights, *args, **kwargs)
    bound = bind_embeddings(self, sidecar)
    text_config = getattr(self.config, "text_config", self.config)
    parts = getattr(text_config, "split_ngram_parts", getattr(self.config, "split_ngram_parts", 512))
    stream = _Filter(weights, bound, parts)
    result = original(self, stream, *args, **kwargs)
    self._ssd_stream_spot_checks = stream.checked  # evidence for tests and the log line below
    apply_scales(bound, sidecar, stream.scales_seen)
    start_prefetch(self, bound)
    self._ssd_stream_hot = keep_hot(bound, sidecar)
    self._ssd_stream_metrics = export_metrics(bound, self._ssd_stream_hot)
    log.info("PLE sidecar: %d layer(s) bound, %d PLE shard tensor(s) skipped, %d of them spot-checked against "
             "the sidecar", len(bound), stream.dropped, stream.checked)
    _ran("load_weights", "layers %s bound to the sidecar, %d PLE shard tensor(s) skipped, %d spot-checked",
         sorted(bound), stream.dropped, stream.checked)
    return result


def start_prefetch(model, bound: dict):
    """One prompt-ahead prefetcher over the row caches of ``model`` (none with the cache off), reachable
    from the scheduler hooks of this process (:mod:`.prefetch`). The hashes come from the loaded
    modules' buffers (a checkpoint may override them), after ``load_weights`` filled them."""
    if not config.row_cache_mb():
        return None
    from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding

    from ..sidecar.ngram import NGramHash
    from ..sidecar.prefetch import PromptPrefetcher
    from . import prefetch

    layers = []
    for _, mod in model.named_modules():
        if isinstance(mod, Qwen4ExpNGramEmbedding) and mod.ngram_embedding in bound.values():
            h = NGramHash.from_module(mod, rows=mod.ngram_embedding.org_vocab_size)
            layers.append((mod.ngram_embedding._ssd_stream_layer, h, mod.ngram_embedding._ssd_stream.reader))
    layers.sort(key=lambda x: x[0])  # forward order
    chunk, window = config.chunk_tokens(), config.prefetch_chunks()
    prefetcher = PromptPrefetcher([(h, cache) for _, h, cache in layers], chunk_tokens=chunk, window=window)
    prefetch.register(model, prefetcher)
    log.info("PLE prompt-ahead prefetch: %d layer(s), %d chunk(s) of %d tokens ahead (%s)", len(layers), window,
             chunk, config.PREFETCH_ENV)
    return prefetcher


def _ranks() -> tuple[int | None, int | None]:
    """This scheduler's TP and PP ranks from sglang's parallel state (None: a rank this process never wrote, as
    in tests). sglang 0.5.23's ``sglang.srt.distributed`` no longer exports ``get_tensor_model_parallel_rank``:
    importing it from there left both ranks unknown in real servers too."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    ranks = []
    for name in ("tp_rank", "pp_rank"):
        try:
            rank = getattr(parallel, name)
        except (RuntimeError, AttributeError):  # "has not been written in this process"
            rank = None
        ranks.append(rank if isinstance(rank, int) and not isinstance(rank, bool) else None)
    return ranks[0], ranks[1]


def _process_role() -> str:
    """This scheduler's hot-file role (:func:`..sidecar.hot_rows.process_role`)."""
    import torch

    from ..sidecar.hot_rows import process_role

    tp, pp = _ranks()
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
    return process_role("sglang", gpu=gpu, tp=tp, pp=pp)


def export_metrics(bound: dict, hot):
    """The kit's ``ssd_stream_*`` series of this scheduler's PLE layers and hot file in sglang's ``/metrics``
    (:mod:`..ple_metrics`): published when sglang runs prometheus_client in multiprocess mode, which
    ``--enable-metrics`` turns on (its launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the
    schedulers); None otherwise (one log line)."""
    from ..ple_metrics.publish import for_process
    from ..sidecar.row_cache import RowCache

    tp, pp = _ranks()
    metrics = for_process("sglang", tp_rank=tp, pp_rank=pp)
    if metrics is None:
        return None
    for layer, emb in bound.items():
        gather = emb._ssd_stream
        metrics.layer(layer, gather.reader if isinstance(gather.reader, RowCache) else None, gather)
    if hot is not None:
        metrics.hot_loaded(hot)
    metrics.start()
    return metrics


def keep_hot(bound: dict, sidecar: config.Sidecar):
    """Read the hot file into the row caches before the first request and keep writing it
    (``SGLANG_SSD_STREAM_HOT_SHARE_PCT`` > 0 with a row cache; :mod:`..sidecar.hot_rows`); None when off."""
    from . import settings

    s = settings.current()
    if not s.row_cache_mb or not s.hot_share_pct or not bound:
        return None
    from ..sidecar.hot_rows import HotRows

    caches = {layer: emb._ssd_stream.reader for layer, emb in bound.items()}
    hot = HotRows(sidecar.manifest, caches, share=s.hot_share_pct / 100, interval_s=s.hot_interval_s,
                  role=_process_role())
    hot.load()
    hot.start()
    return hot


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def around_gather(original, self, input_ids, out=None):
    state = getattr(self, "_ssd_stream", None)
    if state is None:
        if _is_placeholder(self.weight):
            raise SidecarHookError("PLE gather on a sidecar table that load_weights never bound")
        return original(self, input_ids, out)
    import torch

    shape = (*input_ids.shape, self.embedding_dim)
    if out is None:
        output = self.allocate_output(shape, input_ids.device)
    else:
        if tuple(out.shape) != shape or out.dtype != torch.bfloat16 or out.device != input_ids.device:
            raise ValueError(f"invalid PLE prefetch output {out.dtype} {tuple(out.shape)} on {out.device}, "
                             f"expected bfloat16 {shape} on {input_ids.device}")
        output = out
    if _capturing():  # sglang captures decode steps: the read becomes a host node of the graph
        state.capture(input_ids.reshape(-1).long(), output.view(-1, self.embedding_dim), torch.cuda.current_stream())
        return output
    state.begin(input_ids.reshape(-1).long(), output.view(-1, self.embedding_dim),
                torch.cuda.current_stream() if state.cuda else None)
    if out is None:  # forward(): sglang reduces right after, so the rows must be enqueued now
        state.wait()
    _ran("gather", "layer %d, %d ids read through %s", self._ssd_stream_layer, input_ids.numel(), state.reader.io)
    return output


def around_consume(original, self, *args, **kwargs):
    state = getattr(self.ple_embedding.ngram_embedding, "_ssd_stream", None)
    if state is not None:
        state.wait()
        _ran("consume", "layer %d waited for its staged rows", self.ple_embedding.ngram_embedding._ssd_stream_layer)
    return original(self, *args, **kwargs)
