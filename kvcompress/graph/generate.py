"""`generate()` with the decode steps replayed from a CUDA graph: a decoding method for transformers.

    kvcompress.enable(model)
    cache = CompressedCache(model.config, "nuq4")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256,
                         custom_generate=kvcompress.graph_generate)

transformers calls a callable `custom_generate` as its decoding method, after its usual preparation
(generation config, logits processors, stopping criteria, the cache). `graph_generate` prefills the prompt
through the cache, then runs every new token through a `DecodeGraph` (a CUDA graph on the GPU, the same
fixed-address steps eagerly elsewhere). Greedy search and sampling with the configured logits processors
(temperature, top-k, top-p, repetition penalty, ...) and stopping criteria (max length, EOS) work as in
transformers' own loop; rows that finished get the pad token. Beam search, assisted decoding and
`return_dict_in_generate` are not supported (a clear error says so). Prompts of different lengths are
left-padded as usual: the attention mask gives each row's start. A graph holds sparse layers (H2O, Quest) of
unpadded batches only: a padded batch over a sparse cache decodes its steps eagerly here (`EagerSteps`), with
generate()'s mask and positions, so the call still works.
"""

from __future__ import annotations

import torch

from kvcompress.config import ConfigError


@torch.no_grad()
def graph_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
) -> torch.LongTensor:
    """transformers decoding method (see the module doc): returns the prompt and new tokens [B, T + n]."""
    from kvcompress.cache import CompressedCache
    from kvcompress.compat import with_cache
    from kvcompress.graph.decode_graph import DecodeGraph

    cache = model_kwargs.get("past_key_values", model_kwargs.get("cache"))
    if not isinstance(cache, CompressedCache):
        raise ConfigError("graph_generate needs a CompressedCache: pass past_key_values=CompressedCache(...)")
    if getattr(generation_config, "num_beams", 1) > 1 or generation_config.return_dict_in_generate:
        raise ConfigError(
            "graph_generate does greedy search and sampling only, returning the token ids "
            "(num_beams=1, return_dict_in_generate=False)"
        )
    if cache.get_seq_length():
        raise ConfigError("graph_generate prefills the prompt itself: pass an empty CompressedCache")
    mask = model_kwargs.get("attention_mask")
    batch, length = input_ids.shape
    positions = None
    if mask is not None and not bool(mask.all()):
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **with_cache(cache),
    ).logits[:, -1]
    max_length = generation_config.max_length
    graph = None
    pad = generation_config._pad_token_tensor  # set by generate()'s preparation (5.17 and 5.24 alike)
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    while True:
        scores = logits_processor(
            input_ids, logits.to(torch.float32, copy=True)
        )  # the graph reuses its buffer
        if generation_config.do_sample:
            token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            token = scores.argmax(-1)
        if pad is not None:
            token = torch.where(unfinished, token, pad)
        input_ids = torch.cat([input_ids, token[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(token.cpu())
        unfinished &= ~stopping_criteria(input_ids, scores)
        if not bool(unfinished.any()) or input_ids.shape[1] >= max_length:
            break
        if graph is None and positions is not None and any(
                getattr(layer, "sparse", None) is not None for layer in cache.layers):
            graph = EagerSteps(model, cache, mask)
        elif graph is None:
            graph = DecodeGraph(
                model, cache, max_tokens=max_length, attention_mask=mask if positions is not None else None
            )
        logits = graph.step(token[:, None])
    if streamer is not None:
        streamer.end()
    if graph is not None:
        graph.release()
    return input_ids


class EagerSteps:
    """Decode steps as plain forwards, with DecodeGraph's `step` / `release`: for a cache a graph cannot hold
    (H2O or Quest over a left-padded batch). mask [B, T]: the prompt's attention mask; each step extends it and takes
    generate()'s positions (each row counts from its first real token)."""

    def __init__(self, model, cache, mask: torch.Tensor):
        self.model, self.cache, self.mask = model, cache, mask

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token [B, 1] -> logits [B, vocab] of the next one."""
        from kvcompress.compat import with_cache

        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], 1)
        positions = self.mask.sum(-1, keepdim=True) - 1
        return self.model(token, attention_mask=self.mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                          **with_cache(self.cache)).logits[:, -1]

    def release(self) -> None:
        """Nothing to give back: the cache grew as usual."""
