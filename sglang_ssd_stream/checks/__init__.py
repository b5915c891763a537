"""Engine-neutral checks both doctors and both plugins share, judged the same way for either engine.

- :mod:`.host`: facts of this host (CPU budget and cgroup quota, meminfo, the Jetson L4T release, free disk) and
  the thread sizing that follows from them;
- :mod:`.memory`: the locked-memory limit and the row cache against MemAvailable × processes;
- :mod:`.sidecar`: the sidecar loaded by the one loader and trust rule, its SHA-256 checked once per process.

Each check takes values (never a variable name it reads itself) and returns findings; the engine doctors gather
their own launch facts and name their own knobs.
"""
