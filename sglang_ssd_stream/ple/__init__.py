"""SGLang adapter of the PLE sidecar: hooks (:mod:`.hooks`), GPU staging (:mod:`.staging`),
the FP8/BF16 → BF16 conversion kernel (:mod:`.kernels`) and configuration (:mod:`.config`).

Importing this package imports nothing heavy; :mod:`.kernels`/:mod:`.staging` need torch and
triton, :mod:`.hooks` needs sglang.
"""
