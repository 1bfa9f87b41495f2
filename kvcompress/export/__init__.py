"""Exports of a kvcompress config for serving engines (vLLM, SGLang, TensorRT-LLM)."""
