"""Capacity planner: KV bytes per token, pool sizes, Mamba slots, and whether it all fits.

Arithmetic of write-up 000 §3/§5/§9 (12 full-attention layers x 2 KV heads x 256 x 2 B x (K+V) =
24 KiB/token BF16, 6 GiB at 262,144 tokens; FP8 halves it) and of sglang 0.5.23's pool sizing
(``QSATokenToKVPool.qsa_bytes_per_token``: index-K bytes / compress ratio per full layer; the draft
pool has one slot per target token). Everything is computed from config.json and flags; a plan
that cannot work is refused with the numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ModelConfigError, PlanRefused

GIB = 1 << 30
# config.json layer_types sglang 0.5.23 counts as attention (configs/qwen4_exp.py layers_block_type) and as GDN
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "qwen_sparse_attention", "indexed_attention"})
LINEAR_LAYER_TYPE = "linear_attention"
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "auto": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8": 1,
               "float32": 4}


# sglang 0.5.23 budgets Mamba slots per running request by its radix-cache strategy, not by the draft
# (KVCacheConfigurator._calculate_mamba_ratio + allocation_sizing.get_mamba_tracking_slots): one slot with
# the radix cache off; else 3 (own state, the locked cached state, one spare) plus the strategy's tracking
# slots. Speculative decoding's per-step states are separate buffers. It caps max_running_requests to
# slots // ratio at start. Write-up 000 §9 (extra_buffer_lazy: 16 slots for 4 requests, 5 admitted 1) is
# this ratio, 4; the e2e suite measures the radix-off ratio, 1, in the real server.
MAMBA_BASE_RATIO = 3
MAMBA_TRACKING_SLOTS = {"extra_buffer_lazy": 1, "extra_buffer": 2, "no_buffer": 0}


def mamba_slots_per_request(*, radix_cache: bool = True, strategy: str = "auto", overlap: bool = True,
                            page_size: int = 1) -> int:
    """The Mamba slots sglang reserves per running request for this launch (see above)."""
    if not radix_cache:
        return 1
    if strategy == "auto":  # arg_groups/overrides.py: extra_buffer with overlap or paging, else no_buffer
        strategy = "extra_buffer" if overlap or page_size > 1 else "no_buffer"
    if strategy not in MAMBA_TRACKING_SLOTS:
        raise PlanRefused(f"unknown --mamba-radix-cache-strategy {strategy!r}: expected auto or one of "
                          f"{', '.join(MAMBA_TRACKING_SLOTS)}")
    tracking = MAMBA_TRACKING_SLOTS[strategy]
    if strategy == "extra_buffer" and not overlap:
        tracking = 1
    return MAMBA_BASE_RATIO + tracking


def mamba_slots_per_request_of(value, has) -> int:
    """:func:`mamba_slots_per_request` for a launch: ``value(flag)`` gives a flag's value or None, ``has(flag)``
    whether a bare switch is set."""
    return mamba_slots_per_request(
        radix_cache=not has("--disable-radix-cache"), strategy=value("--mamba-radix-cache-strategy") or "auto",
        overlap=not has("--disable-overlap-schedule"), page_size=int(value("--page-size") or 1))


def mamba_slots_needed(running: int, per_request: int) -> int:
    return running * per_request


@dataclass(frozen=True)
class Geometry:
    """What the planner needs from config.json (text_config for multimodal checkpoints)."""

    num_layers: int
    full_attention_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    mtp_layers: int | None  # None: the config does not say (only a plan that drafts needs it)
    qsa_index_kv_heads: int = 0
    qsa_index_head_dim: int = 0
    qsa_compress_ratio: int = 1
    gdn_value_heads: int = 0
    gdn_key_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    gdn_conv_kernel: int = 0


def _field(cfg: dict, name: str, path: str, *alts: str, default=None):
    for key in (name, *alts):
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    if default is not None:
        return default
    raise ModelConfigError(f"{path}: field {name!r} is missing; the planner will not guess it")


def load_geometry(config_path: str | os.PathLike) -> Geometry:
    p = Path(config_path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{p}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{p}: not JSON ({exc})") from None
    cfg = cfg.get("text_config") or cfg
    path = str(p)
    n = int(_field(cfg, "num_hidden_layers", path))
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ModelConfigError(f"{path}: layer_types has {len(types)} entries for {n} layers")
        unknown = sorted(set(types) - ATTENTION_LAYER_TYPES - {LINEAR_LAYER_TYPE})
        if unknown:
            raise ModelConfigError(f"{path}: layer type(s) {', '.join(map(repr, unknown))} unknown to the planner "
                                   f"(it knows {', '.join(sorted(ATTENTION_LAYER_TYPES | {LINEAR_LAYER_TYPE}))})")
        full = sum(1 for t in types if t in ATTENTION_LAYER_TYPES)
    else:
        interval = int(_field(cfg, "full_attention_interval", path))  # Qwen3-Next: every 4th layer
        full = n // interval
    heads = int(_field(cfg, "num_key_value_heads", path))
    head_dim = int(_field(cfg, "head_dim", path))
    # Needed only when a plan drafts (plan() refuses then); a config without it is planned with MTP off.
    mtp = cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers"))
    mtp = None if mtp is None else int(mtp)
    g = dict(num_layers=n, full_attention_layers=full, linear_layers=n - full, kv_heads=heads, head_dim=head_dim,
             mtp_layers=mtp)
    if cfg.get("indexer_n_heads") is not None:  # compressed QSA (sglang qsa/config.py)
        g.update(qsa_index_kv_heads=int(_field(cfg, "indexer_kv_heads", path)),
                 qsa_index_head_dim=int(_field(cfg, "indexer_head_dim", path)),
                 qsa_compress_ratio=int(_field(cfg, "indexer_compress_ratio", path)))
    if n - full:
        g.update(gdn_value_heads=int(_field(cfg, "linear_num_value_heads", path)),
                 gdn_key_heads=int(_field(cfg, "linear_num_key_heads", path)),
                 gdn_key_dim=int(_field(cfg, "linear_key_head_dim", path)),
                 gdn_value_dim=int(_field(cfg, "linear_value_head_dim", path)),
                 gdn_conv_kernel=int(_field(cfg, "linear_conv_kernel_dim", path)))
    for k, v in g.items():
        if v is None:
            continue
        if v < 0 or (k in ("num_layers", "kv_heads", "head_dim", "qsa_compress_ratio") and v == 0):
            raise ModelConfigError(f"{path}: {k}={v} is impossible")
    return Geometry(**g)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every full-attention layer: 12 x 2 x 256 x 2 B x 2 = 24 KiB (BF16)."""
    return layers * kv_heads * head_dim * _dtype_bytes(dtype) * 2


def _dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise PlanRefused(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


def qsa_bytes_per_token(g: Geometry, dtype: str = "bfloat16") -> int:
    """Compressed index keys only (sglang ``qsa_bytes_per_token``); the pending ring is per request."""
    if not g.qsa_index_head_dim:
        return 0
    return (g.qsa_index_kv_heads * g.qsa_index_head_dim * _dtype_bytes(dtype) // g.qsa_compress_ratio
            * g.full_attention_layers)


def mamba_bytes_per_slot(g: Geometry, ssm_dtype: str = "float32", conv_dtype: str = "bfloat16") -> int:
    """One request state of every GDN layer: SSM [value_heads, key_dim, value_dim] + conv window."""
    ssm = g.gdn_value_heads * g.gdn_key_dim * g.gdn_value_dim * _dtype_bytes(ssm_dtype)
    conv_dim = 2 * g.gdn_key_heads * g.gdn_key_dim + g.gdn_value_heads * g.gdn_value_dim
    conv = conv_dim * max(g.gdn_conv_kernel - 1, 0) * _dtype_bytes(conv_dtype)
    return (ssm + conv) * g.linear_layers


def log_gb(nbytes: int) -> float:
    """As sglang logs a buffer ("K size: 3.00 GB", GB = 2**30, ``:.2f``)."""
    return float(f"{nbytes / GIB:.2f}")


@dataclass
class Plan:
    context_length: int
    pool_tokens: int
    page_size: int
    running: int
    draft_steps: int
    mamba_slots: int
    target_kv_dtype: str
    draft_kv_dtype: str
    bytes_per_token: dict = field(default_factory=dict)
    at_context_gib: dict = field(default_factory=dict)
    pool_gib: dict = field(default_factory=dict)
    sglang_log_gb: dict = field(default_factory=dict)
    mamba: dict = field(default_factory=dict)
    sharing: dict = field(default_factory=dict)
    memory: dict | None = None
    ple_row_cache: dict | None = None  # host memory of the PLE row cache (row_cache_budget), outside the device fit

    def to_json(self) -> dict:
        return asdict(self)


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The files model.safetensors.index.json maps (or the one ``model.safetensors``), each checked present."""
    root = Path(model_dir)
    idx = root / "model.safetensors.index.json"
    try:
        shards = set(json.loads(idx.read_text())["weight_map"].values())
    except FileNotFoundError:
        single = root / "model.safetensors"
        if single.is_file():
            return [single]
        raise ModelConfigError(f"{root}: no model.safetensors.index.json; pass --weights-gib") from None
    except (json.JSONDecodeError, KeyError, AttributeError) as exc:
        raise ModelConfigError(f"{idx}: unreadable weight_map ({exc})") from None
    for s in sorted(shards):
        if not (root / s).is_file():
            raise ModelConfigError(f"{root}: shard {s} listed in the index is missing")
    return [root / s for s in sorted(shards)]


def weights_bytes(model_dir: str | os.PathLike) -> int:
    """Sum of the shards model.safetensors.index.json maps (what the engine loads; the PLE sidecar
    is streamed, so a view built as in 000 §3 lists no PLE shard)."""
    return sum(f.stat().st_size for f in weight_files(model_dir))


def in_place_ple_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the PLE tables an in-place ``ssd-stream.json`` in ``model_dir`` serves from the shards its index
    maps: on disk once, streamed, never resident (0 without such a manifest, or for a copied sidecar)."""
    from ..sidecar.format import MANIFEST_NAME
    from ..sidecar.view import load_sidecar

    if not (Path(model_dir) / MANIFEST_NAME).is_file():
        return 0
    regions = [r for t in load_sidecar(model_dir, check_files=False).tables if t.in_place for r in t.regions]
    if not regions:
        return 0
    mapped = {os.path.realpath(f) for f in weight_files(model_dir)}
    return sum(r.bytes for r in regions if os.path.realpath(r.file) in mapped)


def plan(g: Geometry, *, context_length: int, pool_tokens: int | None, running: int, draft_steps: int,
         mamba_slots: int | None, page_size: int = 1, mamba_per_request: int | None = None,
         target_kv_dtype: str = "bfloat16",
         draft_kv_dtype: str | None = None, qsa_dtype: str = "bfloat16", ssm_dtype: str = "float32",
         device_memory_gib: float | None = None, mem_fraction: float | None = None,
         weights_gib: float | None = None, tensor_parallel: int = 1) -> Plan:
    """Compute a plan, or raise PlanRefused with the arithmetic that makes it impossible.

    With ``pool_tokens=None`` the pool is the largest page-aligned size that fits the memory left
    after weights (device memory x mem_fraction - weights - Mamba states).
    """
    draft_kv_dtype = draft_kv_dtype or target_kv_dtype
    for name, v in (("context length", context_length), ("running requests", running), ("page size", page_size)):
        if v < 1:
            raise PlanRefused(f"{name} must be at least 1, got {v}")
    if draft_steps < 0:
        raise PlanRefused(f"draft steps must be >= 0, got {draft_steps}")
    # sglang's ratio when the launch's flags are known; else the write-up's rule (1 + draft states), which is
    # sglang's for NEXTN 3 steps under extra_buffer_lazy
    per_request = mamba_per_request if mamba_per_request is not None else 1 + draft_steps
    need_slots = mamba_slots_needed(running, per_request)
    if mamba_slots is None:
        mamba_slots = need_slots
    if g.linear_layers and mamba_slots < need_slots:
        raise PlanRefused(
            f"{mamba_slots} Mamba slots admit only {mamba_slots // per_request} of {running} running requests: "
            f"each holds {per_request} slot(s), so {need_slots} slots are needed")

    if tensor_parallel < 1:
        raise PlanRefused(f"tensor parallel size must be at least 1, got {tensor_parallel}")
    # Per rank: KV heads are split over TP ranks and replicated when TP exceeds them (2 heads, TP4 -> 1 each).
    heads = -(-g.kv_heads // tensor_parallel)
    target = kv_bytes_per_token(g.full_attention_layers, heads, g.head_dim, target_kv_dtype)
    if draft_steps and g.mtp_layers is None:
        raise PlanRefused("the plan drafts (MTP) but the config gives neither mtp_num_hidden_layers nor "
                          "num_nextn_predict_layers; the planner will not guess the draft's layer count")
    draft = kv_bytes_per_token(g.mtp_layers, heads, g.head_dim, draft_kv_dtype) if draft_steps else 0
    qsa = qsa_bytes_per_token(g, qsa_dtype)
    per_token = target + draft + qsa
    if not per_token:
        raise PlanRefused("the config has no attention layer, so no KV per token: nothing to plan a pool for")
    slot = mamba_bytes_per_slot(g, ssm_dtype) if g.linear_layers else 0
    mamba_total = slot * mamba_slots

    memory = None
    if device_memory_gib is not None or mem_fraction is not None or weights_gib is not None:
        if None in (device_memory_gib, mem_fraction, weights_gib):
            raise PlanRefused("a memory check needs all of device memory, mem fraction and weights")
        if not 0 < mem_fraction <= 1:
            raise PlanRefused(f"mem fraction must be in (0, 1], got {mem_fraction}")
        static = device_memory_gib * mem_fraction * GIB
        left = static - weights_gib * GIB
        if left <= mamba_total:
            raise PlanRefused(
                f"weights take {weights_gib:.2f} GiB of the {static / GIB:.2f} GiB static budget "
                f"({device_memory_gib:g} GiB x {mem_fraction:g}); {max(left, 0) / GIB:.2f} GiB is left, "
                f"not enough for {mamba_slots} Mamba slots ({mamba_total / GIB:.2f} GiB) plus any KV")
        fit_tokens = int((left - mamba_total) // per_token) // page_size * page_size
        if pool_tokens is None:
            pool_tokens = fit_tokens
        need = pool_tokens * per_token + mamba_total
        if need > left:
            raise PlanRefused(
                f"a {pool_tokens:,}-token pool needs {need / GIB:.2f} GiB (KV {pool_tokens * per_token / GIB:.2f} + "
                f"Mamba {mamba_total / GIB:.2f}) but only {left / GIB:.2f} GiB is left after {weights_gib:.2f} GiB "
                f"of weights; at most {fit_tokens:,} tokens fit")
        memory = {"static_gib": static / GIB, "weights_gib": weights_gib, "left_after_weights_gib": left / GIB,
                  "needed_gib": need / GIB, "headroom_gib": (left - need) / GIB, "max_pool_tokens": fit_tokens}
    if pool_tokens is None:
        raise PlanRefused("no pool size: pass --max-total-tokens, or device memory, mem fraction and weights")
    if pool_tokens % page_size:
        raise PlanRefused(f"pool of {pool_tokens:,} tokens is not a multiple of the {page_size}-token KV page; "
                          f"use {pool_tokens // page_size * page_size:,}")
    if context_length > pool_tokens:
        raise PlanRefused(f"context length {context_length:,} exceeds the {pool_tokens:,}-token pool: "
                          f"one request could never fill its window")

    def gib(tokens, b):
        return tokens * b / GIB

    rows = context_length + page_size

    return Plan(
        context_length=context_length, pool_tokens=pool_tokens, page_size=page_size, running=running,
        draft_steps=draft_steps, mamba_slots=mamba_slots, target_kv_dtype=target_kv_dtype,
        draft_kv_dtype=draft_kv_dtype,
        bytes_per_token={"target_kv": target, "draft_kv": draft, "qsa_index_k": qsa, "total": per_token},
        at_context_gib={"target_kv": gib(context_length, target), "draft_kv": gib(context_length, draft),
                        "qsa_index_k": gib(context_length, qsa),
                        "target_plus_draft": gib(context_length, target + draft),
                        "total": gib(context_length, per_token)},
        pool_gib={"target_kv": gib(pool_tokens, target), "draft_kv": gib(pool_tokens, draft),
                  "qsa_index_k": gib(pool_tokens, qsa), "total": gib(pool_tokens, per_token)},
        # sglang's buffers hold size + page_size rows (slot 0 pads), which is why the write-up's
        # draft K reads "0.13 GB" for an exact 0.125 GiB.
        sglang_log_gb={"context": {"K": log_gb(rows * target // 2), "V": log_gb(rows * target // 2),
                                   "draft_K": log_gb(rows * draft // 2), "draft_V": log_gb(rows * draft // 2)}},
        mamba={"slots": mamba_slots, "needed": need_slots, "bytes_per_slot": slot, "total_gib": mamba_total / GIB,
               "per_request": per_request, "admits_requests": mamba_slots // per_request},
        sharing={"full_windows": pool_tokens // context_length,
                 "full_windows_exact": pool_tokens / context_length,
                 "per_running_request": pool_tokens // running,
                 "two_session_each": pool_tokens // 2},
        memory=memory,
    )


def row_cache_budget(knob: tuple[str, int] | None, profile_env, env, override_mb: int | None = None,
                     when: tuple[str, str, tuple[str, ...]] | None = None) -> dict | None:
    """The PLE row cache a launch gets: ``override_mb`` (plan's option), else the exported variable (a
    launch keeps what the operator exported, :func:`.launch.build_launch`), else the profile's value, else
    the engine's default. None: the
    engine has no row cache, or not with this launch's ``when`` setting (:class:`.side.EngineSide`).
    Registered host memory, apart from the per-layer staging the engine logs."""
    if knob is None:
        return None
    if when is not None:
        var, default, values = when
        if env.get(var, profile_env.get(var, default)) not in values:
            return None
    from ..knobs import by_name

    var, default = knob
    if override_mb is not None:
        raw, source = str(override_mb), "this plan's --row-cache-mb"
    elif var in env and env[var] != profile_env.get(var):  # a launch's env holds the profile's value too
        raw, source = env[var], "exported"
    elif var in profile_env:
        raw, source = profile_env[var], "the profile's"
    else:
        raw, source = None, "the default"
    try:
        mb = default if raw is None else by_name(var).parse(raw)
    except ValueError as exc:
        raise PlanRefused(str(exc)) from None
    return {"variable": var, "mib": mb, "gib": mb / 1024, "source": source}


def sessions_of(plan: Plan, tokens: int) -> int:
    """How many concurrent sessions of ``tokens`` the shared pool holds (also capped by running slots)."""
    return min(plan.pool_tokens // tokens, plan.running)


def render(plan: Plan) -> str:
    b, c, p, m, s = plan.bytes_per_token, plan.at_context_gib, plan.pool_gib, plan.mamba, plan.sharing
    lines = [
        f"KV per token: target {b['target_kv'] / 1024:g} KiB ({plan.target_kv_dtype}) + draft "
        f"{b['draft_kv'] / 1024:g} KiB ({plan.draft_kv_dtype}) + QSA index K {b['qsa_index_k']} B = {b['total']:,} B",
        f"at the {plan.context_length:,}-token context: target {c['target_kv']:.2f} GiB, "
        f"draft {c['draft_kv']:.2f} GiB, QSA {c['qsa_index_k'] * 1024:.0f} MiB, total {c['total']:.2f} GiB",
        f"pool of {plan.pool_tokens:,} tokens: {p['total']:.2f} GiB (target {p['target_kv']:.2f}, "
        f"draft {p['draft_kv']:.2f}, QSA {p['qsa_index_k']:.2f})",
        f"Mamba: {m['slots']} slots ({m['needed']} needed for {plan.running} requests x {m['per_request']} each; "
        f"admits {m['admits_requests']} at once), {m['total_gib']:.2f} GiB",
        f"sharing: {s['full_windows']} full windows ({s['full_windows_exact']:.2f}); two sessions of up to "
        f"{s['two_session_each']:,} each; {plan.running} requests average {s['per_running_request']:,} each",
    ]
    rc = plan.ple_row_cache
    if rc is not None:
        lines.append(f"PLE row cache: {rc['mib']:,} MiB of registered host memory for all PLE layers "
                     f"({rc['variable']}={rc['mib']}, {rc['source']})" if rc["mib"] else
                     f"PLE row cache: off ({rc['variable']}=0, {rc['source']}): rows are read through the page "
                     f"cache")
        if rc["mib"]:
            lines.append("  host memory beside the device fit below; on unified memory (Jetson Thor) the KV cache "
                         "cannot use it; the per-layer staging is stated in the server's startup log")
    if plan.memory:
        mem = plan.memory
        lines.append(f"memory: {mem['static_gib']:.2f} GiB static - {mem['weights_gib']:.2f} GiB weights = "
                     f"{mem['left_after_weights_gib']:.2f} GiB; plan needs {mem['needed_gib']:.2f} GiB, headroom "
                     f"{mem['headroom_gib']:.2f} GiB (largest pool {mem['max_pool_tokens']:,} tokens)")
    return "\n".join(lines)
