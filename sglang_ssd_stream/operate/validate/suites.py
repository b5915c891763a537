"""The validation suites of write-up 000, run against any OpenAI-compatible server.

- ``needle``: three codes at 10/50/90% depth, prompts growing from the shortest needle prompt (template,
  question and needles, measured on the server) to the context limit (000 §6).
- ``truncation``: an over-long prompt (x1.075, 281,896 vs 262,144 in 000 §8) with a small
  ``max_tokens`` must end with ``finish_reason=length`` inside the window, then KV returns to 0.
- ``soak``: two sessions, each cycle continue -> compress -> refill (000 §9, 2 x 3 cycles = 12 stages).
- ``matrix``: thinking on/off x tools on/off x reasoning history kept or not, 8 agent turns (000 §10).
- ``canary``: token-id 0 runs, NaN log-probabilities, degenerate repetition on every reply.

Every loop is bounded; once the server stops answering, remaining steps are recorded as skipped.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from . import canary
from .client import Client, Reply, tool_schema
from .filler import Filler, needle_codes, with_needles

SUITES = ("needle", "truncation", "soak", "matrix", "canary")
DEPTHS = (0.1, 0.5, 0.9)
LENGTH_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 3 / 4, 15 / 16, 1.0)
OVERLONG = 1.075  # 281,896 / 262,144 in the write-up's truncation regression


@dataclass
class Settings:
    context_length: int
    pool_tokens: int | None = None
    answer_tokens: int = 64
    truncation_max_tokens: int = 8
    lengths: tuple[int, ...] | None = None
    cycles: int = 3
    soak_tokens: int | None = None
    continue_tokens: int = 1024
    compact_tokens: int = 4096
    turns: int = 8
    turn_tokens: int = 512
    canary_tokens: int = 256
    kv_zero_wait_s: float = 30.0
    # what the engine does with a prompt over the window: "truncate" (SGLang with --allow-auto-truncate, the
    # kit's profiles: it must finish with the client's budget) or "refuse" (vLLM 0.33 has no auto-truncate: a
    # clean HTTP 400 naming the limit, never a hang)
    overlong: str = "truncate"
    seed: int = 1184
    progress: bool = True


@dataclass
class Run:
    client: Client
    settings: Settings
    on_event: object = None  # callable(name, data) for observers (tests, logs)
    dead: str | None = None  # why the server is considered gone
    cpt: float = 4.0  # characters per token, calibrated
    overhead: int = 0  # chat-template tokens around the user text
    kv_samples: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def event(self, name: str, **data) -> None:
        if self.on_event is not None:
            self.on_event(name, data)

    def chars_for(self, tokens: int) -> int:
        return max(int((tokens - self.overhead) * self.cpt), 1)

    def request(self, messages, **kw) -> Reply:
        if self.dead:
            return Reply(ok=False, error=f"skipped: {self.dead}")
        reply = self.client.chat(messages, **kw)
        if not reply.ok and not self.client.alive():
            with self._lock:
                self.dead = self.dead or f"server stopped answering ({reply.error})"
        self.event("reply", reply=reply)
        return reply

    def sample_kv(self, label: str) -> dict | None:
        kv = None if self.dead else self.client.kv_usage()
        if kv is not None:
            self.kv_samples.append({"t": time.time(), "label": label, **kv})
        return kv

    def wait_kv_zero(self) -> dict:
        """Poll (2 s period, bounded) until the server reports no KV in use and nothing running."""
        deadline = time.monotonic() + self.settings.kv_zero_wait_s
        while True:
            kv = self.sample_kv("drain")
            if kv is None:
                return {"status": "unknown", "detail": "server does not expose KV use" if not self.dead else self.dead}
            used = kv.get("used_tokens", kv.get("used_fraction"))
            if not used and not kv.get("running"):
                return {"status": "pass", "detail": "KV back to zero", "kv": kv}
            if time.monotonic() >= deadline:
                return {"status": "fail", "detail": f"KV did not return to zero in {self.settings.kv_zero_wait_s:g} s",
                        "kv": kv}
            time.sleep(2.0)


def _bar(run: Run, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not run.settings.progress, leave=False)


def repetition_limit(budget: int) -> int:
    """The longest run of one token a reply of ``budget`` tokens may hold: half the reply for short
    budgets (a 16-token reply can never show a 32-token run), the canary's limit from 64 tokens on."""
    return min(canary.MAX_IDENTICAL_RUN, max(canary.MAX_ZERO_RUN, budget // 2))


def _canary_of(r: Reply, budget: int) -> canary.CanaryResult:
    # Scaled only where the reply is counted in tokens; characters keep the fixed limit
    # (a short reply can hold a run of 8 '=' or spaces that means nothing).
    per_token = r.token_ids is not None or r.tokens is not None
    return canary.check(text=r.content + r.reasoning, token_ids=r.token_ids, tokens=r.tokens, logprobs=r.logprobs,
                        completion_tokens=r.completion_tokens,
                        max_identical_run=repetition_limit(budget) if per_token else canary.MAX_IDENTICAL_RUN)


def prompt_cost(run: Run, text: str) -> int | None:
    """Tokens ``text`` adds to a one-message chat prompt, measured with a 1-token request (None if it fails)."""
    r = run.client.chat([{"role": "user", "content": text}], max_tokens=1)
    if not r.ok or not r.prompt_tokens:
        return None
    return max(r.prompt_tokens - run.overhead, 0)


def calibrate(run: Run) -> dict:
    """Characters per token from two prompt sizes (slope) and the template overhead (intercept)."""
    f = Filler(run.settings.seed + 1)
    small = max(min(run.settings.context_length // 8, 512), 16)
    sizes = (small, small * 2)
    points = []
    for n in sizes:
        text = f.text(n * 4)
        r = run.client.chat([{"role": "user", "content": text}], max_tokens=1)
        if not r.ok or not r.prompt_tokens:
            raise ConnectionError(r.error or "no usage.prompt_tokens in the reply")
        points.append((len(text), r.prompt_tokens))
    (c1, p1), (c2, p2) = points
    run.cpt = (c2 - c1) / max(p2 - p1, 1)
    run.overhead = max(int(round(p1 - c1 / run.cpt)), 0)
    return {"chars_per_token": run.cpt, "template_tokens": run.overhead}


def _status(checks: list[dict]) -> str:
    states = {c["status"] for c in checks}
    if "fail" in states:
        return "fail"
    if "skipped" in states:
        return "incomplete"
    return "pass" if "pass" in states else "unknown"


def needle(run: Run) -> dict:
    s = run.settings
    room = s.context_length - s.answer_tokens - 16
    checks, f = [], Filler(s.seed)
    question = "\n\nWhat are the three secret code numbers in the text above? Reply with the three numbers only."

    def fixed_text(codes) -> str:
        return question + "".join(f"The secret code number {k} is {c}. " for k, c in enumerate(codes, 1))

    # The question and the needle sentences (digits) do not tokenize like the filler: their cost is
    # measured on the server once; only if that fails are they costed at one token per character.
    measured = None if run.dead else prompt_cost(run, fixed_text(needle_codes(s.seed)))
    extra_of = (lambda codes: measured) if measured is not None else (lambda codes: len(fixed_text(codes)))
    # The shortest needle prompt is the template, the question and the needles with no filler: the
    # targets spread from there to the room (at 262,144 tokens that floor is noise; at 256 it is a third).
    floor = run.overhead + extra_of(needle_codes(s.seed))
    lengths = s.lengths or tuple(floor + int(max(room - floor, 0) * fr) for fr in LENGTH_FRACTIONS)
    with _bar(run, len(lengths), "needle") as bar:
        for i, n in enumerate(lengths):
            codes = needle_codes(s.seed + i)
            body = with_needles(f.text(max(run.chars_for(n - extra_of(codes)), 0)), DEPTHS, codes)
            r = run.request([{"role": "user", "content": body + question}], max_tokens=s.answer_tokens, stream=True)
            kv = run.sample_kv(f"needle {n}")
            found = [c in (r.content + r.reasoning) for c in codes]
            status = "skipped" if (r.error or "").startswith("skipped") else ("pass" if r.ok and all(found) else "fail")
            checks.append({"target_tokens": n, "prompt_tokens": r.prompt_tokens, "status": status, "recalled": found,
                           "latency_s": r.latency_s, "ttft_s": r.ttft_s, "finish_reason": r.finish_reason,
                           "error": r.error, "kv": kv, "canary": _canary_of(r, s.answer_tokens).__dict__})
            bar.update()
    return {"status": _status(checks), "fixed_tokens": measured, "floor_tokens": floor, "checks": checks}


def truncation(run: Run) -> dict:
    s = run.settings
    target = int(s.context_length * OVERLONG)
    text = Filler(s.seed + 2).text(run.chars_for(target))
    r = run.request([{"role": "user", "content": text + "\n\nContinue the story."}], max_tokens=s.truncation_max_tokens)
    checks = []

    def add(name, ok, detail):
        checks.append({"check": name, "status": "skipped" if (r.error or "").startswith("skipped") else
                       ("pass" if ok else "fail"), "detail": detail})

    if s.overlong == "refuse":
        add("refused with HTTP 400", r.status == 400, r.error or f"accepted: finish_reason={r.finish_reason}")
        add("the refusal names the window", r.status == 400 and str(s.context_length) in (r.error or ""),
            (r.error or "")[:300])
    else:
        add("request finished", r.ok, r.error or f"finish_reason={r.finish_reason}")
    if r.ok and s.overlong != "refuse":
        add("finish_reason=length", r.finish_reason == "length", f"finish_reason={r.finish_reason}")
        add("output budget kept", r.completion_tokens == s.truncation_max_tokens,
            f"completion_tokens={r.completion_tokens}, max_tokens={s.truncation_max_tokens}")
        total = (r.prompt_tokens or 0) + (r.completion_tokens or 0)
        add("fits the window", total <= s.context_length,
            f"prompt {r.prompt_tokens} + completion {r.completion_tokens} = {total} vs context {s.context_length} "
            f"(sent ~{target})")
    drain = run.wait_kv_zero()
    checks.append({"check": "KV returns to zero", **drain})
    after = run.request([{"role": "user", "content": "Say OK."}], max_tokens=4)
    checks.append({"check": "short request afterwards", "status": "pass" if after.ok else
                   ("skipped" if (after.error or "").startswith("skipped") else "fail"),
                   "detail": after.error or f"finish_reason={after.finish_reason}"})
    return {"status": _status(checks), "sent_tokens_estimate": target, "prompt_tokens": r.prompt_tokens,
            "latency_s": r.latency_s, "checks": checks}


def soak_budgets(s: Settings) -> tuple[int, int, int]:
    """(per-session prompt, continue, compress) tokens, scaled to the context.

    The write-up's budgets (1,024 continue, 4,096 compress) are for a 262,144-token window; each output
    budget is capped at a sixteenth (continue) and an eighth (compress) of the context, which leaves
    them unchanged there and lets a small server soak too. Each session's prompt is 45 % of the pool."""
    cont = max(1, min(s.continue_tokens, s.context_length // 16))
    comp = max(1, min(s.compact_tokens, s.context_length // 8))
    pool = s.pool_tokens or s.context_length
    per_session = s.soak_tokens or int(min(pool * 0.45, s.context_length - cont - comp))
    return per_session, cont, comp


def soak(run: Run) -> dict:
    s = run.settings
    per_session, cont_tokens, comp_tokens = soak_budgets(s)
    budgets = {"per_session_tokens": per_session, "continue_tokens": cont_tokens, "compact_tokens": comp_tokens}
    if per_session < 16 or per_session + cont_tokens + comp_tokens > s.context_length:
        return {"status": "fail", **budgets, "completed": 0, "planned": 4 * s.cycles, "checks": [
            {"check": "room for two sessions", "status": "fail",
             "detail": f"{per_session} prompt + {cont_tokens} continue + {comp_tokens} compress tokens per session "
                       f"in a {s.context_length}-token context (pool {s.pool_tokens or s.context_length})"}]}
    stages: list[dict] = []
    stop = threading.Event()

    def sampler():
        while not stop.wait(2.0):
            run.sample_kv("soak")

    def session(k: int, bar):
        f = Filler(s.seed + 10 + k)
        body = f.text(run.chars_for(per_session))
        for cycle in range(s.cycles):
            for stage, prompt, budget in (
                ("continue", "\n\nContinue the story.", cont_tokens),
                ("compress", "\n\nRewrite everything above as a dense record about half as long.", comp_tokens),
            ):
                r = run.request([{"role": "user", "content": body + prompt}], max_tokens=budget)
                stages.append({"session": k, "cycle": cycle, "stage": stage, "prompt_tokens": r.prompt_tokens,
                               "completion_tokens": r.completion_tokens, "latency_s": r.latency_s,
                               "finish_reason": r.finish_reason, "error": r.error,
                               "status": "skipped" if (r.error or "").startswith("skipped") else
                               ("pass" if r.ok else "fail"), "canary": _canary_of(r, budget).problems})
                bar.update()
                if stage == "compress":  # refill: the summary, the latter half, then fresh text to the target
                    half = body[len(body) // 2:]
                    body = (r.content + " " + half + f.text(run.chars_for(per_session)))[: run.chars_for(per_session)]

    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    t0 = time.monotonic()
    with _bar(run, 2 * 2 * s.cycles, "soak") as bar:
        workers = [threading.Thread(target=session, args=(k, bar)) for k in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    stop.set()
    t.join(5)
    drain = run.wait_kv_zero()
    peaks = [x.get("used_tokens", 0) for x in run.kv_samples if x["label"] == "soak" and "used_tokens" in x]
    checks = stages + [{"check": "KV returns to zero", **drain}]
    return {"status": _status(checks), **budgets, "seconds": time.monotonic() - t0,
            "completed": sum(1 for x in stages if x["status"] == "pass"), "planned": 4 * s.cycles,
            "peak_kv_tokens": max(peaks) if peaks else None, "checks": checks}


def matrix(run: Run) -> dict:
    s = run.settings
    cells = []
    combos = list(itertools.product((True, False), (True, False), (True, False)))
    with _bar(run, len(combos) * s.turns, "matrix") as bar:
        for thinking, tools, keep in combos:
            messages = [{"role": "user", "content": "Inspect the project with the shell_probe tool, one question per "
                                                    "turn, then summarise what you learned."}]
            turns, tool_turns, bad_args, problems, prompt_sizes, errors = 0, 0, 0, [], [], []
            for turn in range(s.turns):
                r = run.request(messages, max_tokens=s.turn_tokens, tools=tool_schema() if tools else None,
                                thinking=thinking)
                bar.update()
                if not r.ok:
                    errors.append(r.error)
                    break
                turns += 1
                prompt_sizes.append(r.prompt_tokens)
                problems += _canary_of(r, s.turn_tokens).problems
                assistant = {"role": "assistant", "content": r.content}
                if keep and r.reasoning:
                    assistant["reasoning_content"] = r.reasoning
                calls = [c for c in r.tool_calls if (c.get("function") or {}).get("name")]
                if calls:
                    tool_turns += 1
                    assistant["tool_calls"] = calls
                    messages.append(assistant)
                    for c in calls:
                        try:
                            json.loads(c["function"].get("arguments") or "{}")
                        except json.JSONDecodeError:
                            bad_args += 1
                        messages.append({"role": "tool", "tool_call_id": c.get("id") or f"call-{turn}",
                                         "content": f"probe result {turn}: 42 files, clean tree"})
                else:
                    messages.append(assistant)
                    messages.append({"role": "user", "content": "Continue with the next step."})
            reasons = []
            if errors:
                reasons.append(f"request failed: {errors[0]}")
            if tools and turns and not tool_turns:
                reasons.append("no structured tool_calls with tools on")
            if bad_args:
                reasons.append(f"{bad_args} tool calls with non-JSON arguments")
            reasons += problems
            skipped = bool(errors) and errors[0].startswith("skipped")
            cells.append({"thinking": thinking, "tools": tools, "history_reasoning": keep, "turns": turns,
                          "tool_call_turns": tool_turns, "prompt_tokens": prompt_sizes,
                          "status": "skipped" if skipped else ("fail" if reasons else "pass"), "problems": reasons})
    return {"status": _status(cells), "checks": cells}


CANARY_PROMPTS = (
    "Write a JSON object describing three fruits with their colours.",
    "Count from 1 to 40, separated by commas.",
    "Explain in two sentences why the sky is blue.",
)


def canary_suite(run: Run) -> dict:
    s, checks = run.settings, []
    with _bar(run, len(CANARY_PROMPTS), "canary") as bar:
        for p in CANARY_PROMPTS:
            r = run.request([{"role": "user", "content": p}], max_tokens=s.canary_tokens, logprobs=True)
            c = _canary_of(r, s.canary_tokens)
            status = "skipped" if (r.error or "").startswith("skipped") else ("pass" if r.ok and c.ok else "fail")
            checks.append({"prompt": p, "status": status, "error": r.error, "finish_reason": r.finish_reason,
                           **c.__dict__})
            bar.update()
    return {"status": _status(checks), "checks": checks}


RUNNERS = {"needle": needle, "truncation": truncation, "soak": soak, "matrix": matrix, "canary": canary_suite}
