"""Sparsity policies: which tokens a layer keeps (H2O, StreamingLLM, SnapKV) or reads (Quest)."""
