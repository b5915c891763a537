"""The kit's series in each engine's Prometheus endpoint: :mod:`.series` (the definitions), :mod:`.publish`
(publishing them from a serving process). Stdlib only at import; prometheus_client is imported when a process
publishes."""
