"""Deterministic filler text and needles, generated locally (no corpus download).

The write-ups used a public-domain novel; a seeded word stream gives the same property (long,
non-repeating, reproducible) without the network. Token counts are estimated with a
characters-per-token ratio that the suites calibrate from the server's own ``usage`` numbers.
"""

from __future__ import annotations

import random

_WORDS = (
    "harbor lantern quiet river stone window garden letter morning captain journey silver market old "
    "island road tower winter summer bridge forest valley mountain candle evening story ship merchant "
    "castle prison treasure friend enemy promise secret count abbe sailor storm wind wave shore night "
    "door key map king queen soldier village city street square church bell clock hour minute paper "
    "ink book shelf table chair bread wine water fire smoke ash dust cloud rain snow field wheat horse "
    "cart wheel rope anchor sail deck mast cabin voyage return fortune debt honor patience hope time"
).split()


class Filler:
    """A reproducible text stream: ``text(n_chars)`` is a prefix of the same stream for one seed."""

    def __init__(self, seed: int = 1184):
        self.seed = seed
        self._buf = ""
        self._rng = random.Random(seed)

    def text(self, n_chars: int) -> str:
        while len(self._buf) < n_chars:
            words = [self._rng.choice(_WORDS) for _ in range(self._rng.randint(6, 14))]
            self._buf += " ".join(words).capitalize() + ". "
        return self._buf[:n_chars]


def needle_codes(seed: int, n: int = 3) -> list[str]:
    rng = random.Random(seed * 7919 + 1)
    return [str(rng.randint(100000, 999999)) for _ in range(n)]


def with_needles(body: str, depths: tuple[float, ...], codes: list[str]) -> str:
    """Insert ``The secret code number {i} is {code}.`` at each depth (fraction of the body)."""
    out, last = [], 0
    for i, (d, code) in enumerate(zip(depths, codes, strict=False), 1):
        cut = (body.rfind(". ", 0, max(int(len(body) * d), 1)) + 2 if ". " in body[: int(len(body) * d)]
               else int(len(body) * d))
        out.append(body[last:cut])
        out.append(f"The secret code number {i} is {code}. ")
        last = cut
    out.append(body[last:])
    return "".join(out)
