"""Prompt-ahead prefetch in vLLM 0.33's worker: the rows of a prefill's next chunks, read into the row caches.

vLLM 0.33 runs qwen4_exp on its V2 model runner (``vllm/v1/worker/gpu/model_runner.py``; the
n-gram context plumbing ``Qwen4ExpModelState`` is V2's). Each step, ``GPUModelRunner.execute_model``
applies the scheduler's output to the request states (``finish_requests``, ``add_requests``,
``update_requests``) before it prepares the inputs. Right after ``update_requests`` the step's plan
is complete and the forward has not been enqueued: for every request prefilled this step,
:meth:`PromptHook.step` calls :meth:`~sglang_ssd_stream.sidecar.prefetch.PromptPrefetcher.scheduled`
with the request's prefill tokens and ``[num_computed_tokens, num_computed_tokens + num_scheduled)``,
and :meth:`~sglang_ssd_stream.sidecar.prefetch.PromptPrefetcher.finished` for the finished and
preempted ones (and for a request whose prefill is complete). Those calls only queue work for the
prefetcher's background thread: the runner never hashes, reads or waits for the disk.

One :class:`~sglang_ssd_stream.sidecar.prefetch.PromptPrefetcher` per process, built right after
``GPUModelRunner.load_model`` from the loaded model: per PLE layer, the n-gram hash from the
buffers vLLM really uses (``Qwen4ExpNGramEmbedding.layer_multipliers``, ``ngram_heads_vocab_sizes``,
``ngram_heads_offsets``, which a checkpoint may override; bit-exact with vLLM's hashing:
``tests/vllm/checks/check_ngram_hash.py``) and that layer's row cache; chunks of vLLM's
``max_num_batched_tokens``; the window ``VLLM_PLE_PREFETCH_CHUNKS``.

What it did is in the worker's log: a request that leaves while its prefill is unfinished (aborted, or
preempted) gets one line (its id, where it stopped, the chunks of it the prefetcher read); the activity
line (the prefetcher's and the row caches' counters, prefills done and left unfinished, and any chunk read
for a request after it left) follows such a leave, and any other one at most every :data:`REPORT_EVERY_S`.
The chunks read per request are counted on the prompt the hook hands over (:class:`_Prompt`, a copy made
once per request): the prefetch thread slices a request's prompt once for each chunk it fetches.

With MTP (a speculator in the runner), a verify step's rows are read ahead too (issue 27 item 3): right after
``sample_tokens`` has sampled and the speculator has proposed, each decoding request's next verify row (its last
sampled token, then its drafts: ``req_states.last_sampled_tokens`` and ``draft_tokens``) and its n-gram history
(the ``ngram_size - 1`` tokens before ``num_computed_tokens`` in ``all_token_ids``, EOS before the start, as
``Qwen4ExpModelState._prepare_ngram_context`` reads them at the next step) are copied off the device with an
event (:mod:`sglang_ssd_stream.staging.verify_rows`), and the prefetch thread fetches their rows before any
prompt chunk, while the engine schedules the next step. A request still prefilling is left out (its drafts are
not verified next). On a CPU, with nothing to overlap, they are fetched before ``sample_tokens`` returns, and the
disk reads of the target forwards that only verify (``execute_model`` of a step whose every request is
decoding) are counted for the activity line.

Fatal, never silent: a row cache built in a process whose runner loads a model without it, and
the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0`` or a feature V2 lacks) with a row cache, stop
the worker with the fix named. Installed by :mod:`.activate` through :mod:`.post_import` only when
a streamed backend runs with a row cache. Not covered: an MTP draft model's PLE layers are read
through their caches but not prefetched (their tokens are shifted by one); with data parallelism a
rank prefetches for its own requests only.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Sequence

from . import LOGGER_NAME, env, runtime_guard
from .errors import PleSettingsError

log = logging.getLogger(LOGGER_NAME)
KIT_LOGGER = "sglang_ssd_stream"  # the engine-neutral floors' loggers (the hot file's among them)

RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"
_MARK = "_vllm_ple_prompt_prefetch"  # set on our wrappers: installing again is a no-op
REPORT_EVERY_S = 60.0  # the activity line's period in the log (as sglang's); a request left unfinished logs at once
REPORT_FIRST = 8  # the first prefills after a start each get an activity line (as sglang's first requests)

_lock = threading.Lock()
_hook: PromptHook | None = None  # this process's (one runner per worker process)


class _Prompt(list):
    """A request's prefill tokens as the hook hands them to the prefetcher: a copy (made once per request) that
    counts the chunks the prefetch thread reads from it. The thread slices a request's prompt once per chunk it
    fetches (``PromptPrefetcher._run``; nothing else slices it), so a slice is a chunk fetched for this request,
    and one taken after the request left is a chunk fetched for a request that is gone."""

    def __init__(self, tokens: Sequence[int], start: int, late: list[int]):
        super().__init__(tokens)
        self.start = start  # the computed tokens when it arrived (a prefix-cache hit): nothing before is fetched
        self.scheduled_to = start  # the end of its last scheduled chunk
        self.chunks = 0  # chunks the prefetch thread read for it
        self.fetched_to = start  # the end of the furthest of them
        self.gone = False
        self._late = late  # the hook's count of chunks read for requests after they left

    def __getitem__(self, index):
        if isinstance(index, slice):
            if self.gone:
                self._late[0] += 1
            else:
                self.chunks += 1
                self.fetched_to = max(self.fetched_to, min(len(self), index.stop if index.stop is not None
                                                           else len(self)))
        return super().__getitem__(index)


class PromptHook:
    """Feeds one prefetcher from the scheduler outputs the runner applies (see the module docstring)."""

    def __init__(self, prefetcher):
        self.prefetcher = prefetcher
        self._prompts: dict[str, _Prompt] = {}  # requests still prefilling -> their prefill tokens
        self._late = [0]  # chunks read for a request after it left (the prefetcher drops them: must stay 0)
        self.done = 0  # prefills that ran to their end
        self.done_tokens = 0  # their prompt tokens from where each started (a prefix-cache hit is not fetched)
        self.unfinished = 0  # requests that left with their prefill unfinished (aborted, preempted)
        self.unfinished_tokens = 0  # the tokens of theirs fetched by the time they left
        self._reported = 0.0
        self._drafted_said = False
        self.verify_steps = 0  # CPU only: target forwards of pure verify steps, and their lookups that read the disk
        self.verify_misses = 0

    @property
    def late_chunks(self) -> int:
        """Chunks the prefetch thread read for a request after the hook told it the request had left."""
        return self._late[0]

    def _leave(self, req_id: str, why: str) -> None:
        """Request ``req_id`` left the prefill (``why``: done, finished, preempted, re-added): the prefetcher drops
        its queued chunks; then the log (see the module docstring)."""
        prompt = self._prompts.pop(req_id, None)
        if prompt is None:
            return
        self.prefetcher.finished(req_id)
        prompt.gone = True
        unfinished = prompt.scheduled_to < len(prompt)
        if unfinished:
            self.unfinished += 1
            self.unfinished_tokens += prompt.fetched_to - prompt.start
            log.info("PLE prompt-ahead prefetch: request %s left (%s) with its prefill unfinished, scheduled to "
                     "token %d of %d (from %d): %d chunk(s) of it fetched, to token %d", req_id, why,
                     prompt.scheduled_to, len(prompt), prompt.start, prompt.chunks, prompt.fetched_to)
        else:
            self.done += 1
            self.done_tokens += len(prompt) - prompt.start
        now = time.monotonic()
        if unfinished or self.done + self.unfinished <= REPORT_FIRST or now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            log.info("%s", self.activity_line())

    def activity_line(self) -> str:
        """What the prefetcher did and what the row caches saw (the counters since the hook was built)."""
        s = self.prefetcher.stats
        totals: dict[str, int] = {}
        for _, cache in self.prefetcher.layers:
            for k, v in cache.stats.items():
                totals[k] = totals.get(k, 0) + v
        hits, lookups = totals.get("hits", 0), totals.get("lookups", 0)
        prompts = list(self._prompts.values())
        in_flight = sum(p.fetched_to - p.start for p in prompts)
        return (f"PLE prompt-ahead prefetch: {s.chunks_fetched} chunk(s) fetched ({s.tokens_fetched} tokens) of "
                f"{s.chunks_queued} queued, {s.chunks_dropped} dropped, {s.scheduled_calls} scheduled call(s), busy "
                f"{s.seconds_busy:.3f} s; prefills: {self.done} done ({self.done_tokens} tokens), {self.unfinished} "
                f"left unfinished ({self.unfinished_tokens} tokens fetched), {len(prompts)} in flight ({in_flight} "
                f"tokens fetched), {self.late_chunks} chunk(s) read after their request left; row caches over "
                f"{len(self.prefetcher.layers)} layer(s): {totals.get('prefetch_rows', 0)} rows prefetched, {hits} of "
                f"{lookups} lookups hit "
                f"({hits / max(lookups, 1):.1%}), {totals.get('prefetch_hits', 0)} on prefetched rows, "
                f"{totals.get('rows_read', 0)} rows read from disk"
                + (f"; {s.draft_steps} verify step(s) fetched ahead ({s.draft_tokens} tokens, {s.draft_steps_dropped} "
                   f"superseded" + (f", {s.draft_rows_read} rows placed" if s.draft_rows_read else "") + ")"
                   if s.draft_steps or s.draft_steps_dropped else "")
                + (f"; verify forwards on this CPU: {self.verify_steps}, their lookups that read the disk: "
                   f"{self.verify_misses}" if self.verify_steps else "")
                + (f"; errors: {s.errors}" if s.errors else ""))

    def prefilling(self) -> set[str]:
        """Requests whose prefill is not computed to its end yet (their drafts are not verified next)."""
        return {r for r, p in self._prompts.items() if p.scheduled_to < len(p)}

    def drafted(self, runner, input_batch) -> None:
        """After ``sample_tokens``: the next verify step's rows of every decoding request, to the prefetch thread
        (see the module docstring)."""
        import torch

        from sglang_ssd_stream.staging.verify_rows import verify_rows_source

        n = int(input_batch.num_reqs)
        skip = self.prefilling()
        keep = [i for i, r in enumerate(input_batch.req_ids[:n]) if r not in skip]
        if not keep:
            return
        state, rs = runner.model_state, runner.req_states
        with torch.inference_mode():
            # every row of the batch: the prefilling ones are dropped on the host (an index tensor made here would
            # be a host-to-device copy that waits for the step's work)
            idx = input_batch.idx_mapping[:n].long()
            tokens = torch.cat([rs.last_sampled_tokens[idx].to(torch.int64), rs.draft_tokens[idx]], dim=1)
            ctx = int(state.ngram_context_len)
            end = rs.num_computed_tokens.gpu[idx].long()
            pos = end.unsqueeze(1) + torch.arange(-ctx, 0, device=end.device)
            history = rs.all_token_ids.gpu[idx.unsqueeze(1), pos.clamp_min(0)].to(torch.int64)
            history = torch.where(pos >= 0, history, torch.full_like(history, int(state.ngram_eos_token_id)))
            source, on_device = verify_rows_source(tokens, history, keep if len(keep) < n else None)
        self.prefetcher.drafted(source, wait=not on_device)
        if not self._drafted_said:
            self._drafted_said = True  # said once per process, as the hook's other first lines
            log.info("PLE prefetch: the rows of a verify step (%d request(s), %d tokens each) fetched ahead of its "
                     "forward", len(keep), tokens.shape[1])

    def misses(self) -> int:
        return sum(cache.stats["miss_lookups"] for _, cache in self.prefetcher.layers)

    def _schedule(self, req_id: str, prompt: _Prompt, computed: int, scheduled: int) -> None:
        if computed >= len(prompt):  # prefill done (decode, or the last chunk was computed)
            prompt.scheduled_to = max(prompt.scheduled_to, computed)
            self._leave(req_id, "done")
            return
        if scheduled > 0:
            prompt.scheduled_to = min(len(prompt), computed + scheduled)
            self.prefetcher.scheduled(req_id, prompt, computed, computed + scheduled)

    def step(self, scheduler_output) -> None:
        """The runner applied ``scheduler_output`` (vLLM's ``SchedulerOutput``); queue its prefills."""
        for req_id in scheduler_output.finished_req_ids:
            self._leave(req_id, "finished")
        for req_id in scheduler_output.preempted_req_ids or ():
            self._leave(req_id, "preempted")  # V2 removes them; a resumed one comes back as new
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
            if tokens is None:  # prompt embeddings: no token ids to hash
                continue
            self._leave(new.req_id, "re-added")  # streaming input: start afresh
            prompt = self._prompts[new.req_id] = _Prompt(tokens, new.num_computed_tokens, self._late)
            self._schedule(new.req_id, prompt, new.num_computed_tokens, counts.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            prompt = self._prompts.get(req_id)
            if prompt is not None:
                self._schedule(req_id, prompt, computed, counts.get(req_id, 0))

    @property
    def tracked(self) -> int:
        """Requests whose prefill tokens the hook still holds."""
        return len(self._prompts)

    def close(self) -> None:
        self.prefetcher.close()


def prefetch_layers(model) -> list:
    """``(NGramHash, RowCache)`` of every streamed PLE layer with a row cache in ``model``, forward order."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    from sglang_ssd_stream.sidecar.ngram import NGramHash

    from .embedding import StreamedPLEEmbedding

    layers = []
    for module in model.modules():
        inner = getattr(module, "ngram_embedding", None)
        if not isinstance(module, Qwen4ExpNGramEmbedding) or not isinstance(inner, StreamedPLEEmbedding) \
                or inner.row_cache is None:
            continue
        hasher = NGramHash.from_module(module, rows=inner.org_vocab_size)
        layers.append((hasher, inner.row_cache))
    return layers


def build(model, *, chunk_tokens: int, settings: env.PleSettings) -> PromptHook | None:
    """This process's hook for the loaded ``model`` (replacing an earlier one); None when the model
    has no cached streamed PLE layer and this process built no row cache."""
    global _hook
    from sglang_ssd_stream.sidecar.prefetch import PromptPrefetcher
    from sglang_ssd_stream.staging.host_memory import fmt_bytes

    from .embedding import _ROW_CACHES

    layers = prefetch_layers(model)
    built = [c for c in _ROW_CACHES if c.usable]
    if not layers:
        if built:
            raise PleSettingsError(
                f"this worker built {len(built)} PLE row cache(s), but the model vLLM's runner loaded holds none of "
                f"them, so prompt-ahead prefetch cannot reach them; report this with the model, or set "
                f"{env.ROW_CACHE_MB}=0")
        return None
    hook = PromptHook(PromptPrefetcher(layers, chunk_tokens=int(chunk_tokens), window=settings.prefetch_chunks))
    with _lock:
        old, _hook = _hook, hook
    if old is not None:
        old.close()
    keep_hot(model, settings)
    log.info("PLE prompt-ahead prefetch: %d layer(s), chunks of %d tokens (vLLM's max_num_batched_tokens), %d chunk(s) "
             "ahead (%s); into row caches of %s in all", len(layers), chunk_tokens, settings.prefetch_chunks,
             env.PREFETCH_CHUNKS, fmt_bytes(sum(cache.working_set_bytes for _, cache in layers)))
    return hook


def current() -> PromptHook | None:
    return _hook


_hot = None  # this worker's HotRows (sglang_ssd_stream.sidecar.hot_rows), None when the hot file is off


def _role() -> str:
    """This worker's hot-file role (:func:`sglang_ssd_stream.sidecar.hot_rows.process_role`)."""
    import torch

    from sglang_ssd_stream.sidecar.hot_rows import process_role

    tp = pp = None
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        tp, pp = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except (AssertionError, ImportError, RuntimeError, AttributeError):  # no distributed groups (tests)
        pass
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
    return process_role("vllm", gpu=gpu, tp=tp, pp=pp)


def _kit_logs_through_vllm() -> None:
    """The kit's own loggers (``sglang_ssd_stream.*``: the hot file's rows loaded, written, refused) through vLLM's
    handlers, as the plugin's lines go: a vLLM worker's root logger has none, so their INFO lines were lost."""
    kit, vllm_log = logging.getLogger(KIT_LOGGER), logging.getLogger("vllm")
    if kit.handlers or not vllm_log.handlers:
        return
    for handler in vllm_log.handlers:
        kit.addHandler(handler)
    kit.setLevel(vllm_log.getEffectiveLevel())
    kit.propagate = False  # printed once, by vLLM's handlers


def keep_hot(model, settings: env.PleSettings):
    """Read the hot file into the model's row caches before the first request and keep writing it
    (``VLLM_PLE_HOT_SHARE_PCT`` > 0; :mod:`sglang_ssd_stream.sidecar.hot_rows`); None when off."""
    global _hot
    if not settings.hot_share_pct:
        return None
    from sglang_ssd_stream.sidecar.hot_rows import HotRows

    from .embedding import StreamedPLEEmbedding, sidecar_manifest

    caches = {inner.table.layer: inner.row_cache for inner in model.modules()
              if isinstance(inner, StreamedPLEEmbedding) and inner.row_cache is not None}
    if not caches:
        return None
    _kit_logs_through_vllm()
    hot = HotRows(sidecar_manifest(settings), caches, share=settings.hot_share_pct / 100,
                  interval_s=settings.hot_interval_s, role=_role())
    with _lock:
        old, _hot = _hot, hot
    if old is not None:
        old.close()
    hot.load()
    from .exported_metrics import watch_hot

    watch_hot(hot)
    hot.start()
    return hot


# ----------------------------------------------------------------------------- installation


def _ours(fn) -> bool:
    return getattr(fn, _MARK, False)


def _replace(cls, name: str, make, *, vllm_decorated: bool = False) -> None:
    """``cls.name = make(original)``, once; refuses a method someone else already wrapped (vLLM's own
    decorator is expected where ``vllm_decorated``)."""
    current = vars(cls).get(name)
    if _ours(current):
        return
    if not inspect.isfunction(current) or hasattr(current, "__wrapped__") != vllm_decorated:
        raise RuntimeError(f"{cls.__module__}.{cls.__qualname__}.{name} is {current!r}, not vLLM's function; another "
                           f"plugin wrapped it, refusing to stack prompt-ahead prefetch on top")
    wrapper = make(current)
    setattr(wrapper, _MARK, True)
    runtime_guard.own_wrapper(wrapper)  # the guard, if it checks again, looks through it to vLLM's function
    setattr(cls, name, wrapper)
    if vars(cls)[name] is not wrapper:
        raise RuntimeError(f"{cls.__qualname__}.{name}: the prompt-ahead prefetch hook did not take effect")


def install_v2(settings: env.PleSettings):
    """Post-import callback for :data:`RUNNER_V2`: ``load_model`` builds the hook, ``update_requests`` feeds it,
    ``sample_tokens`` hands it a verify step's rows (with MTP), ``execute_model`` counts a CPU verify's reads."""
    def callback(module) -> None:
        cls = module.GPUModelRunner

        def load_model(original):
            @functools.wraps(original)
            def wrapper(self, *args, **kwargs):
                result = original(self, *args, **kwargs)
                build(self.get_model(), chunk_tokens=self.max_num_tokens, settings=settings)
                return result
            return wrapper

        def update_requests(original):
            @functools.wraps(original)
            def wrapper(self, scheduler_output):
                original(self, scheduler_output)
                hook = _hook
                if hook is not None:
                    hook.step(scheduler_output)
            return wrapper

        def sample_tokens(original):
            @functools.wraps(original)
            def wrapper(self, *args, **kwargs):
                state = self.execute_model_state
                batch = state.input_batch if state is not None and self.speculator is not None else None
                result = original(self, *args, **kwargs)
                hook = _hook
                if hook is not None and batch is not None and self.is_last_pp_rank and settings.prefetch_drafts:
                    try:
                        hook.drafted(self, batch)
                    except Exception as exc:  # noqa: BLE001 - advisory, as the prompt chunks' fetch
                        _warn_once("fetching a verify step's rows ahead", exc)
                return result
            return wrapper

        def execute_model(original):
            @functools.wraps(original)
            def wrapper(self, scheduler_output, *args, **kwargs):
                hook = _hook
                counted = (hook is not None and self.speculator is not None and not self.device.type == "cuda"
                           and _pure_verify(scheduler_output))
                before = hook.misses() if counted else 0
                result = original(self, scheduler_output, *args, **kwargs)
                if counted:
                    hook.verify_steps += 1
                    hook.verify_misses += hook.misses() - before
                return result
            return wrapper

        _replace(cls, "load_model", load_model)
        _replace(cls, "update_requests", update_requests)
        _replace(cls, "sample_tokens", sample_tokens, vllm_decorated=True)
        _replace(cls, "execute_model", execute_model, vllm_decorated=True)
    return callback


def _pure_verify(scheduler_output) -> bool:
    """Every request of the step verifies drafts (none prefills): its forward's lookups are the verify rows."""
    drafts = scheduler_output.scheduled_spec_decode_tokens or {}
    counts = scheduler_output.num_scheduled_tokens
    return bool(counts) and all(len(drafts.get(r, ())) + 1 == n for r, n in counts.items())


_warned: set[str] = set()


def _warn_once(what: str, exc: BaseException) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("PLE prefetch: %s failed (%s: %s); serving continues, rows are read on demand", what,
                    type(exc).__name__, exc)


def refuse_v1(settings: env.PleSettings):
    """Post-import callback for :data:`RUNNER_V1`: constructing its runner with a row cache is refused."""
    def callback(module) -> None:
        def init(original):
            @functools.wraps(original)
            def wrapper(self, *args, **kwargs):
                raise PleSettingsError(
                    f"{env.ROW_CACHE_MB}={settings.row_cache_mb}: prompt-ahead prefetch runs in vLLM's V2 model "
                    f"runner, but this worker builds the V1 runner ({RUNNER_V1}: VLLM_USE_V2_MODEL_RUNNER=0, or a "
                    f"feature the V2 runner lacks); use the V2 runner, or set {env.ROW_CACHE_MB}=0")
            return wrapper

        _replace(module.GPUModelRunner, "__init__", init, vllm_decorated=True)  # JitWarmupRegistry.capture
    return callback
