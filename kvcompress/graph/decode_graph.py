"""Whole-model decode steps over a CompressedCache, captured once in a CUDA graph and replayed.

Eager transformers issues about a thousand kernel launches per decode step of an 8B model, and at batch 8
the host, not the GPU, sets the pace (BENCHMARKS.md). A CUDA graph replays the whole step in one launch.

    kvcompress.enable(model)
    cache = CompressedCache(model.config, "nuq4")
    logits = model(prompt, past_key_values=cache).logits          # prefill as usual
    graph = DecodeGraph(model, cache, max_tokens=prompt.shape[1] + new_tokens)
    token = logits[:, -1:].argmax(-1)
    for _ in range(new_tokens):
        token = graph.step(token).argmax(-1, keepdim=True)         # logits [B, vocab]
    graph.release()                                                 # the cache grows normally again

What it needs: the fused path (`kvcompress.enable(model)`, CUDA or KVCOMPRESS_KERNELS=triton), every cache
layer compressed without a sparsity policy (the quantization presets; for MLA models, a latent the fused MLA
kernel reads: kvcompress.kernels.mla_layer) or with H2O over its pages (`nuq4+h2o-20`: the step adds the
attention mass to a score buffer and the host evicts between replays, kvcompress.graph.static_h2o) or Quest
(`nuq4+quest-1024`: the step scores the page summaries and takes the top pages, kvcompress.graph.static_quest;
both for batches without padding), and `max_tokens` (prompt + new tokens): the packed body reserves room for it, so its buffers never move. A batch of prompts of different
lengths, left-padded as `generate()` pads them, passes the prompt's 2-D `attention_mask` [B, T]: each row
then attends from its first real token, and its positions count from there (as generate's do).
The prefill must have used the same positions (`position_ids = attention_mask.cumsum(-1) - 1`).
Steps before every layer holds a packed page run eagerly; then each layer becomes a `StaticLayer`, two
steps run eagerly (Triton compiles, cuBLAS picks its kernels), and the third is captured and replayed from
then on. Between replays the host accounts for the token (`StaticLayer.advance`) and encodes a page when
one is due, eagerly (once every page_size steps per layer).

`step` returns the graph's own logits buffer on replayed steps: read it (or clone it) before the next step.
`use_graph=False` runs the same fixed-address steps eagerly (the CPU tests; the reference for the graph).
"""

from __future__ import annotations

import contextlib

import torch

from kvcompress.config import ConfigError

WARMUP = 2  # eager fixed-address steps before the capture


class DecodeGraph:
    def __init__(
        self,
        model,
        cache,
        max_tokens: int,
        use_graph: bool | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        from kvcompress.cache import CompressedCache, CompressedLayer
        from kvcompress.graph.static_layer import static_sparse_supported
        from kvcompress.kernels.attention_backend import left_padding
        from kvcompress.kernels.backend import select_backend

        if not isinstance(cache, CompressedCache):
            raise ConfigError(f"DecodeGraph needs a CompressedCache, got {type(cache).__name__}")
        if getattr(model, "_kvcompress_hooks", None) is None:
            raise ConfigError(
                "DecodeGraph runs the fused kvcompress path: call kvcompress.enable(model) first"
            )
        device = next(model.parameters()).device
        if select_backend(device) != "triton":
            raise ConfigError(
                "DecodeGraph runs the fused Triton kernels: use a CUDA model (or KVCOMPRESS_KERNELS=triton "
                "with TRITON_INTERPRET=1 on CPU, use_graph=False)"
            )
        for layer in cache.layers:
            if not isinstance(layer, CompressedLayer):
                raise ConfigError(
                    f"layer {layer.layer_idx} is a sliding-window layer; DecodeGraph supports "
                    "full-attention models only"
                )
            if not layer.is_initialized:
                raise ConfigError("prefill the prompt through the cache before building a DecodeGraph")
            if not layer.compressed or (layer.sparse is not None and not static_sparse_supported(layer)):
                raise ConfigError(
                    f"layer {layer.layer_idx} is {'lossless' if not layer.compressed else 'sparse'}: a "
                    "captured step needs every layer quantized (nuq4, int4, fp8, ...), with no sparsity policy "
                    "or with H2O or Quest over its pages (nuq4+h2o-20, nuq4+quest-1024; not StreamingLLM, SnapKV, "
                    "merged H2O, per-kv-head budgets, Quest with budget sharing or page means)"
                )
        seen = cache.get_seq_length()
        if max_tokens <= seen:
            raise ConfigError(
                f"max_tokens ({max_tokens}) must exceed the tokens already in the cache ({seen})"
            )
        self.model, self.cache, self.max_tokens, self.device = model, cache, max_tokens, device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        if self.use_graph and device.type != "cuda":
            raise ConfigError("use_graph=True needs a CUDA model")
        self.statics = None  # the StaticLayers once every layer holds a page
        self.graph = None
        self.eager_static_steps = 0
        batch = cache.layers[0].tail_k.shape[0]
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.logits = None
        self.row_starts = self.pads = None  # left padding: each row's first real position, [B]
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape != (batch, seen):
                raise ValueError(
                    f"attention_mask must be the prompt's [batch, tokens] = [{batch}, {seen}] mask, "
                    f"got {list(attention_mask.shape)}"
                )
            readable, starts = left_padding(attention_mask.to(device))
            if not readable:
                raise ConfigError(
                    "DecodeGraph reads left padding only (each row's padding before its first token)"
                )
            if starts is not None and any(layer.sparse is not None for layer in cache.layers):
                raise ConfigError(
                    "DecodeGraph holds sparse layers (H2O, Quest) for batches without padding only (an evicting "
                    "layer's positions no longer follow the mask; Quest's pages of padding are not masked); "
                    "decode a padded batch eagerly"
                )
            if starts is not None:
                self.row_starts, self.pads = starts, starts.to(torch.long).view(batch, 1)

    # -- one step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token [B, 1] (the newest token of every row) -> logits [B, vocab] of the next one."""
        seen = self.cache.get_seq_length()
        if seen >= self.max_tokens:
            raise ConfigError(f"the decode graph was built for max_tokens={self.max_tokens}; build a new one")
        if token.shape != self.ids.shape:
            raise ValueError(f"token must be [{self.ids.shape[0]}, 1], got {list(token.shape)}")
        self.ids.copy_(token)
        if self.pads is None:
            self.pos.fill_(seen)
        else:  # positions count from each row's first real token
            self.pos.copy_(seen - self.pads)
        if self.statics is None and all(layer.key_store.n_tokens for layer in self.cache.layers):
            self._go_static()
        if self.statics is None:  # a layer has no packed page yet: a normal eager step
            return self._forward()
        self._check_held()
        if self.graph is None and self.use_graph and self.eager_static_steps >= WARMUP:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            out = self.logits
        else:
            out = self._forward()
            self.eager_static_steps += 1
        for s in self.statics:
            s.advance()
        return out

    def _forward(self) -> torch.Tensor:
        from kvcompress.compat import with_cache
        from kvcompress.kernels.attention_backend import known_row_starts

        with contextlib.ExitStack() as scope:
            if self.row_starts is not None:
                scope.enter_context(known_row_starts(self.row_starts))
            out = self.model(
                input_ids=self.ids,
                position_ids=self.pos,
                use_cache=True,
                logits_to_keep=1,
                **with_cache(self.cache),
            )
        return out.logits[:, -1]

    def _go_static(self) -> None:
        from kvcompress.graph.static_layer import StaticLayer

        statics = []
        for layer in self.cache.layers:
            layer.static = StaticLayer(layer, self.max_tokens)
            statics.append(layer.static)
        self.statics = statics

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step (on a side stream); replay() then runs it
            self.logits = self._forward()
        self.graph = graph

    def _check_held(self) -> None:
        for layer, s in zip(self.cache.layers, self.statics):
            if layer.static is not s:
                raise ConfigError(
                    f"layer {layer.layer_idx} left the decode graph (cropped, reordered or reset); "
                    "build a new DecodeGraph"
                )

    def release(self) -> None:
        """Give the cache back to normal, growing decode (e.g. for `generate()`); the graph is dropped."""
        for layer, s in zip(self.cache.layers, self.statics or ()):
            if layer.static is s:
                s.release()
        self.statics, self.graph, self.logits = None, None, None
