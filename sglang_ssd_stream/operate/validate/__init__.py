"""``validate``: needle recall, truncation boundary, dual-session soak, reasoning x tools, canaries.

Entry point: :func:`.runner.run_validation`; suites in :mod:`.suites`; one request per
:class:`.client.Reply`; deterministic text from :mod:`.filler`; report in :mod:`.report`.
"""
