"""Sparsity presets, registered into kvcompress.presets."""
