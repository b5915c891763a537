"""Reading a ``/metrics`` text the way the tests compare it: one place for the parse, the lookup of one sample
and the per-layer view (used by the core tests, both engines' checks and both e2e suites)."""

from __future__ import annotations

Samples = dict[tuple[str, frozenset], float]


def samples(text: str) -> Samples:
    """Every sample of an exposition text: {(sample name, labels): value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: Samples, name: str, **labels) -> float:
    """The one sample ``name`` whose labels include ``labels`` (an assertion when there is none or several)."""
    want = frozenset({k: str(v) for k, v in labels.items()}.items())
    hits = [v for (n, lab), v in found.items() if n == name and want <= lab]
    assert len(hits) == 1, (name, labels, hits, sorted({n for n, _ in found if n.startswith("ssd_stream")}))
    return hits[0]


def by_layer(found: Samples, name: str, engine: str) -> dict[str, float]:
    """``name``'s samples by their ``layer`` label, each asserted to be ``engine``'s, of TP and PP rank 0."""
    out = {}
    for (n, labels), v in found.items():
        if n == name:
            lab = dict(labels)
            assert (lab["engine"], lab["tp_rank"], lab["pp_rank"]) == (engine, "0", "0"), lab
            out[lab["layer"]] = v
    return out
