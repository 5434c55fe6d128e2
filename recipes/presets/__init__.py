"""Shipped model-agnostic presets (installed as ``kvcalib.presets``)."""
