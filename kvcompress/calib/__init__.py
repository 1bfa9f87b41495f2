"""Calibration: codebooks, outlier thresholds, FP8 scales and per-layer choices from real activations."""
