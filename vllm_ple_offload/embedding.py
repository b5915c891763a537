"""The PLE table classes the plugin substitutes for vLLM 0.33's ``Qwen4ExpPLEPinnedHostEmbedding``.

Imported only by the post-import hook, inside a process that builds a qwen4_exp model (it
imports vLLM). Both classes keep the constructor signature and the hooks the model calls
(``supports_prefetch``, ``start_prefetch``, ``finalize_prefetch``, ``dequantize``, ``weight``,
``weight_scale``, ``weight_loader``), and the ETP contract: a rank delivers zeros for rows it does
not own and the existing all-reduce (int8 view for FP8) assembles full rows.

- :class:`RegisteredPinnedPLEEmbedding` (``pinned``): upstream's class with one change, the
  table's host memory (see :mod:`.host_memory`). Lookup, prefetch, reduce are upstream's.
- :class:`StreamedPLEEmbedding` (``mmap``/``pread``): the table stays in the sidecar, read by
  the engine-neutral reader (:func:`sglang_ssd_stream.sidecar.open_reader`), behind a bounded row
  cache unless ``VLLM_PLE_ROW_CACHE_MB=0`` (filled ahead of prefills by :mod:`.prompt_prefetch`), through the shared
  staging (:class:`sglang_ssd_stream.staging.gather.SidecarGather`, eager or as a native host node
  inside FULL CUDA graphs); a zero-element ``weight`` placeholder satisfies the loader (vLLM
  exempts empty placeholders from its "not initialized from checkpoint" check), ``weight_scale``
  is loaded as usual. Checkpoint shards, if the model directory still has them, are not copied:
  one row per shard is compared with the sidecar, and a difference stops the load.
- :class:`RefusedDeviceEmbedding`: with ``VLLM_PLE_CPU_OFFLOAD=1``, upstream's device-resident
  class is only chosen when ``--engram-config`` says ``cpu_offload: false``; that contradiction
  is refused instead of silently keeping the table on the GPU.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import ClassVar

import numpy as np
import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEDeviceEmbedding,
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLENvFp4EmbeddingMethod,
    Qwen4ExpPLEPinnedHostEmbedding,
)

from sglang_ssd_stream.sidecar import check_model_shape, open_reader
from sglang_ssd_stream.sidecar.errors import SidecarChecksumMismatch, SidecarShapeMismatch
from sglang_ssd_stream.sidecar.row_cache import RowCache, captured_read, fixed_bytes, metadata_bytes
from sglang_ssd_stream.staging.gather import SidecarGather
from sglang_ssd_stream.staging.host_memory import account, allocate_registered, fmt_bytes, startup_line

from . import LOGGER_NAME, env
from .errors import PleSettingsError
from .runtime_checks import full_graph_refusal, load_sidecar, require_memlock

log = logging.getLogger(LOGGER_NAME)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def decoder_layer(prefix: str) -> int:
    """Decoder layer index of a PLE embedding prefix (``model.layers.3.ple…`` -> 3)."""
    found = _LAYER.findall(prefix)
    if not found:
        raise SidecarShapeMismatch(f"cannot tell the decoder layer of PLE embedding {prefix!r}", actual=prefix,
                                   expected="a prefix containing 'layers.<index>.'")
    return int(found[-1])


def _integrated_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_properties(torch.cuda.current_device()).is_integrated


def sidecar_manifest(settings) -> object:
    """The sidecar of ``settings``, loaded once per process as the doctor and the plugin's SHA-256 check load it
    (model views and ``VLLM_PLE_TRUSTED_ROOTS`` included)."""
    return _manifest(str(settings.sidecar), settings.trusted_roots)


@functools.lru_cache(maxsize=4)
def _manifest(path: str, trusted_roots: tuple[str, ...]):
    return load_sidecar(path, trusted_roots)


class RegisteredPinnedPLEEmbedding(Qwen4ExpPLEPinnedHostEmbedding):
    """``pinned``: upstream's UVA table in page-aligned, CUDA-registered host memory."""

    settings: ClassVar[env.PleSettings | None] = None

    def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = num_embeddings * embedding_dim * torch.empty((), dtype=dtype).element_size()
        label = getattr(self, "prefix", "") or "table"
        require_memlock(account().total + nbytes, what=f"the PLE table {label}")
        raw = allocate_registered(nbytes, label=label)
        snap = account(table_bytes=nbytes)
        log.info("%s", startup_line(label, nbytes, "registered page-aligned host memory", snap, _integrated_gpu()))
        return raw.view(dtype).view(num_embeddings, embedding_dim)


class RefusedDeviceEmbedding(Qwen4ExpPLEDeviceEmbedding):
    """Upstream's device class, reached only through ``--engram-config '{"cpu_offload": false}'``."""

    def __init__(self, *args, **kwargs):
        raise PleSettingsError(
            f"{env.CPU_OFFLOAD}=1 asks for the PLE table in host memory, but vLLM's engram config keeps it on the "
            f"GPU (--engram-config cpu_offload=false); remove one of the two")


class StreamedPLEEmbedding(Qwen4ExpPLEEmbedding):
    """``mmap``/``pread``: rows streamed from the sidecar through the shared staging.

    Lookup = :class:`~sglang_ssd_stream.staging.gather.SidecarGather` with raw output (the lookup
    dtype's bytes, other ranks' rows zero) into the prefetch buffer, on this table's own prefetch
    stream; then upstream's ETP all-reduce (FP8 as ``int8``) and DP slot selection.

    - eager (no graph, or a breakable PIECEWISE graph, which runs the two ``eager_break`` methods
      eagerly at every replay): ``start_prefetch`` enqueues the ids' D2H copy and returns; a worker
      reads the rows and enqueues their H2D copy; ``_finalize_prefetch`` waits for that worker;
    - inside a FULL CUDA-graph capture (``eager_break_during_capture`` runs the methods inside the
      capture then): D2H of the ids -> native host node reading the rows -> H2D copy into the
      prefetch buffer, all graph nodes replayed with the graph. Allowed for the backends in
      :data:`.env.FULL_GRAPH_BACKENDS` (``mmap``); ``pread`` refuses FULL graphs at build
      (bit-exact there too, but its per-row preads are not hidden behind a decode layer).

    Row cache (``VLLM_PLE_ROW_CACHE_MB`` > 0, the default): the reader is wrapped in a
    :class:`~sglang_ssd_stream.sidecar.row_cache.RowCache` holding this layer's share of the budget
    (:func:`_open_row_cache`); eager lookups read through it and a FULL graph captures its native
    host read (hits copied from memory, misses read with ``O_DIRECT``). ``pread`` still refuses
    FULL graphs with a cache: a decode token's rows are new n-grams, unknown before the step
    (prompt-ahead prefetch covers prompts only), so its misses are disk reads inside the host node,
    as uncached ``pread``'s are. Budget 0: exactly the uncached path.
    """

    supports_prefetch: ClassVar[bool] = True
    settings: ClassVar[env.PleSettings | None] = None

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype, padding_size: int,
                 prefix: str, embedding_method, num_ngram_heads: int = 1, max_total_tokens: int = 0,
                 data_parallel_rank: int = 0, reduce_results: bool = True) -> None:
        settings = self.settings
        if settings is None or not settings.streaming:
            raise RuntimeError("StreamedPLEEmbedding used without streaming settings (the plugin installs it)")
        if isinstance(embedding_method, Qwen4ExpPLENvFp4EmbeddingMethod):
            raise SidecarShapeMismatch(
                f"{prefix}: the checkpoint's PLE table is NVFP4; {env.BACKEND}={settings.backend} streams FP8 and "
                f"BF16 tables only (use {env.BACKEND}=pinned)", actual="nvfp4", expected="float8_e4m3fn or bfloat16")
        _refuse_full_cudagraphs(settings)
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, padding_size=padding_size,
                         prefix=prefix, embedding_method=embedding_method, num_ngram_heads=num_ngram_heads,
                         max_total_tokens=max_total_tokens, data_parallel_rank=data_parallel_rank,
                         reduce_results=reduce_results)
        start, end = self.shard_indices.org_vocab_start_index, self.shard_indices.org_vocab_end_index
        lookup_dtype = embedding_method.lookup_dtype(self)
        self.table = sidecar_manifest(settings).table(decoder_layer(prefix))
        check_model_shape(self.table, dtype=str(lookup_dtype), columns=embedding_dim, rows=self.org_vocab_size,
                          row_range=(start, end))
        self._device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self._prefetch_rows = max_total_tokens * self.etp_data_parallel_size
        self._num_ngram_heads = num_ngram_heads
        self._output_dim = num_ngram_heads * embedding_dim
        self._lookup_dtype = lookup_dtype
        capacity = self._prefetch_rows * num_ngram_heads
        reader = open_reader(self.table, settings.backend, vocab_start=start, vocab_end=end,
                             total_rows=self.org_vocab_size, workers=settings.fetch_workers,
                             rows_per_task=settings.rows_per_task,
                             max_rows=max(1, min(capacity, settings.fetch_workers * settings.rows_per_task)))
        try:
            self.row_cache = _open_row_cache(reader, settings, prefix=prefix, device=self._device)
        except BaseException:
            reader.close()
            raise
        self._reader = reader if self.row_cache is None else self.row_cache  # the cache closes the reader
        self._gather = SidecarGather(self._reader, columns=embedding_dim, is_fp8=lookup_dtype == torch.float8_e4m3fn,
                                     capacity_rows=capacity, device=self._device, mode="h2d", output="raw",
                                     graph_rows=_graph_tokens(max_total_tokens) * self.etp_data_parallel_size
                                     * num_ngram_heads,
                                     host_read=None if self.row_cache is None else captured_read,
                                     capacity_hint=_CAPACITY_HINT)
        if self.row_cache is not None:
            _ROW_CACHES.append(self.row_cache)
        from .exported_metrics import watch_layer

        watch_layer(self.table.layer, self.row_cache, self._gather)
        self._prefetch_buffer: torch.Tensor | None = None
        self._prefetch_stream: torch.cuda.Stream | None = None
        self._prefetch_alloc_lock = threading.Lock()
        self._checked_shards = 0
        self._logged_at = 0
        cache = ("no row cache" if self.row_cache is None else
                 f"row cache {self.row_cache.capacity} rows ({fmt_bytes(self.row_cache.working_set_bytes)}, "
                 f"{self.row_cache.policy}, misses read "
                 f"{'O_DIRECT' if self.row_cache.direct else 'buffered, pages dropped'})")
        log.info("PLE %s: sidecar %s rows [%d, %d), %s reads x %d, %s, staging %s eager + %s graph rows (%s), "
                 "working set %s", prefix, self.table.file, start, end, settings.backend, settings.fetch_workers, cache,
                 capacity, self._gather.graph_rows, fmt_bytes(self._gather.pinned_bytes),
                 fmt_bytes(self._gather.working_set_bytes))

    # ---------------------------------------------------------------- storage and loading

    def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> torch.Tensor:
        # The table lives in the sidecar; an empty placeholder keeps vLLM's loader checks satisfied.
        return torch.empty(0, embedding_dim, dtype=dtype, device="cpu")

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, checkpoint_start: int | None = None):
        if param is not self.weight:
            return super().weight_loader(param, loaded_weight, checkpoint_start)  # weight_scale etc.
        if checkpoint_start is None:
            raise SidecarShapeMismatch(f"{self.prefix}: the checkpoint has an unsharded PLE weight; the streamed "
                                       f"backends expect ngram_embedding.shard_<k>.weight shards or none",
                                       actual="unsharded", expected="shards")
        overlap = self._compute_shard_overlap(checkpoint_start=checkpoint_start, checkpoint_rows=loaded_weight.shape[0])
        if overlap is None:
            return
        if loaded_weight.dtype != self._lookup_dtype or loaded_weight.shape[1] != self.embedding_dim:
            raise SidecarShapeMismatch(
                f"{self.prefix}: checkpoint shard at row {checkpoint_start} is {loaded_weight.dtype} "
                f"{tuple(loaded_weight.shape)}, the sidecar table is {self.table.dtype} x {self.embedding_dim}",
                actual=(str(loaded_weight.dtype), tuple(loaded_weight.shape)), expected=self.table.dtype)
        row = checkpoint_start + overlap.source_start
        want = loaded_weight[overlap.source_start].contiguous().view(torch.uint8).cpu().numpy()
        got = np.empty((1, self.table.row_bytes), dtype=np.uint8)
        self._reader.read_rows(np.array([row], dtype=np.int64), got)
        if not np.array_equal(got[0], want):
            raise SidecarChecksumMismatch(
                f"{self.prefix}: sidecar {self.table.file} row {row} differs from the checkpoint shard starting at "
                f"row {checkpoint_start}; the sidecar was built from another checkpoint", path=str(self.table.file),
                actual=row, expected="identical bytes")
        self._checked_shards += 1

    # ---------------------------------------------------------------- lookup

    def _buffer(self) -> torch.Tensor:
        buffer = self._prefetch_buffer
        if buffer is None:
            with self._prefetch_alloc_lock:
                buffer = self._prefetch_buffer
                if buffer is None:
                    if self._device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                        raise RuntimeError("streamed PLE prefetch buffer must be allocated before CUDA-graph capture")
                    if self._device.type == "cuda":
                        self._prefetch_stream = torch.cuda.Stream(device=self._device)
                    buffer = torch.empty(self._prefetch_rows, self._num_ngram_heads, self.embedding_dim,
                                         dtype=self._lookup_dtype, device=self._device)
                    self._prefetch_buffer = buffer
        return buffer

    @eager_break_during_capture
    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Start the lookup of ``ngram_ids`` ([tokens, heads], int64 on the device) on the prefetch
        stream; never waits for the GPU (see the class docstring)."""
        if ngram_ids.dtype != torch.int64:
            raise TypeError(f"{self.prefix}: PLE n-gram ids must be int64, got {ngram_ids.dtype}"
                            + (" (floating-point ids are refused, not truncated)"
                               if ngram_ids.dtype.is_floating_point else ""))
        buffer = self._buffer()
        slot_size, _ = self._get_dp_gather_slot(ngram_ids.shape[0])
        gathered = self._gather_dp_ids(ngram_ids, slot_size)
        if gathered.shape[0] > buffer.shape[0]:
            raise ValueError(f"streamed PLE prefetch buffer holds {buffer.shape[0]} rows, "
                             f"but the batch needs {gathered.shape[0]}")
        rows = gathered.shape[0] * self._num_ngram_heads
        out = buffer[: gathered.shape[0]].view(torch.uint8).view(rows, self.table.row_bytes)
        self._gather.prefetch(gathered.reshape(-1), out, self._prefetch_stream)  # captured inside a FULL graph
        lookups, interval = self._gather.stats.lookups, self.settings.stats_interval
        if interval and lookups >= self._logged_at + interval:  # eager lookups only: a graph replays unseen
            self._logged_at = lookups
            log.info("PLE %s (%s): %s", self.prefix, self.settings.backend, self._gather.stats.line())

    @eager_break_during_capture
    def _finalize_prefetch(self, prefetch_output: torch.Tensor, output: torch.Tensor) -> None:
        """Wait for the rows, then upstream's ETP reduce and DP slot selection."""
        self._gather.join(self._prefetch_stream)  # eager: re-raises a refused id or a failed read
        slot_size, slot_offset = self._get_dp_gather_slot(output.shape[0])
        embeddings = prefetch_output[: slot_size * self.etp_data_parallel_size]
        if self.reduce_results:
            embeddings = Qwen4ExpPLEPinnedHostEmbedding._reduce_etp_embeddings(self, embeddings)
        else:
            assert self.etp_data_parallel_size == 1  # the outer TP reduce-scatter requires ETP=TP
        embeddings = self._select_embeddings(embeddings, output.shape[0], slot_offset)
        output.copy_(embeddings.flatten(-2))

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        buffer = self._prefetch_buffer
        if buffer is None:
            raise RuntimeError("streamed PLE lookup requires a prior start_prefetch")
        output = buffer.new_empty((total_tokens, self._output_dim))
        self._finalize_prefetch(buffer, output)
        return output

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Streamed PLE embedding requires start_prefetch() and finalize_prefetch().")


_CAPACITY_HINT = "; vLLM's --max-num-batched-tokens and max_cudagraph_capture_size set it"

# The row caches this process built, in construction order (the prompt-ahead prefetch hook checks that
# the model it finds holds them: :mod:`.prompt_prefetch`).
_ROW_CACHES: list[RowCache] = []


def ple_layers(settings: env.PleSettings) -> int:
    """PLE tables of this process: the sidecar manifest's tables (one per PLE decoder layer, every
    rank streams a range of each), which the row cache budget is split over."""
    return len({t.layer for t in sidecar_manifest(settings).tables})


def _open_row_cache(reader, settings: env.PleSettings, *, prefix: str, device: torch.device) -> RowCache | None:
    """This layer's share of ``VLLM_PLE_ROW_CACHE_MB`` as a :class:`RowCache` over ``reader`` (None: 0, off).

    The share is the budget split evenly over the sidecar's PLE layers, capped at what caching this
    rank's whole row range takes. Rows live in CUDA-registered host memory on a GPU (the captured
    read's host node and the staging read them; memlock is checked first), plain memory on CPU.
    Refuses a share that holds no row; any other failure (no compiler for the cache library, the
    registration) propagates: fatal, never a silent fallback to the uncached reader."""
    total = settings.row_cache_bytes
    if not total:
        return None
    layers = max(1, ple_layers(settings))
    share = total // layers
    rb, rows = reader.row_bytes, max(1, reader.vocab_end - reader.vocab_start)
    buffers = fixed_bytes(max_rows=reader.max_rows)
    whole = rows * rb + metadata_bytes(rows) + buffers
    least = buffers + rb + metadata_bytes(1)
    if share < least:
        need_mb = -(-least * layers // (1 << 20))
        raise PleSettingsError(
            f"{env.ROW_CACHE_MB}={settings.row_cache_mb} split over the sidecar's {layers} PLE layer(s) leaves "
            f"{fmt_bytes(share)} per layer, less than one row cache needs ({fmt_bytes(least)}: its read buffers and a "
            f"row); set {env.ROW_CACHE_MB} to at least {need_mb}, or to 0 to turn the row cache off")
    allocate = None
    if device.type == "cuda":
        def allocate(nbytes: int):
            require_memlock(account().total + nbytes, what=f"the PLE row cache of {prefix}")
            return allocate_registered(nbytes, label=f"{prefix} row cache")
    cache = RowCache.for_budget(reader, min(share, whole), allocate=allocate)
    if cache is None:  # cannot happen above `least`; a refusal, never an uncached serve
        raise PleSettingsError(f"{prefix}: a row cache budget of {fmt_bytes(min(share, whole))} holds no row")
    snap = account(cache_bytes=cache.working_set_bytes)
    log.info("%s", startup_line(f"{prefix} row cache", cache.working_set_bytes,
                                f"row cache ({cache.capacity} rows of {rb} B in "
                                f"{'registered' if allocate else 'plain'} host memory + metadata and read buffers; "
                                f"{fmt_bytes(share)} of {env.ROW_CACHE_MB}={settings.row_cache_mb} over {layers} "
                                f"layer(s))", snap, _integrated_gpu()))
    return cache


def _graph_tokens(max_total_tokens: int) -> int:
    """Tokens of the largest batch vLLM may capture into a FULL graph (0 without FULL graphs)."""
    from vllm.config import get_current_vllm_config

    compilation = get_current_vllm_config().compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return 0
    largest = compilation.max_cudagraph_capture_size
    return max_total_tokens if largest is None else min(int(largest), max_total_tokens)


def _refuse_full_cudagraphs(settings: env.PleSettings) -> None:
    """The doctor's graph rule (:func:`.doctor.full_graph_refusal`), applied when vLLM builds the table."""
    from vllm.config import get_current_vllm_config

    refusal = full_graph_refusal(settings, get_current_vllm_config().compilation_config.cudagraph_mode)
    if refusal:
        raise PleSettingsError(refusal)


def select_backend(settings: env.PleSettings) -> type:
    """The class that replaces upstream's pinned-host class for these settings."""
    cls = StreamedPLEEmbedding if settings.streaming else RegisteredPinnedPLEEmbedding
    cls.settings = settings
    return cls
