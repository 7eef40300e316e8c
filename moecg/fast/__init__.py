"""The fused decode step (`capture.kernels=fused`): `step` runs it (FastDecode), `layers` builds the per-layer
weights it reads (FusedLayer, LayerBuilder). moecg.fast.step's docstring says what runs, for which families."""
from moecg.fast.layers import FastPathError
from moecg.fast.step import FUSED_FEATURES, FUSED_ROUTER_KINDS, FastDecode, check_supported

__all__ = ["FUSED_FEATURES", "FUSED_ROUTER_KINDS", "FastDecode", "FastPathError", "check_supported"]
