"""Per-layer sparsity state beside a CompressedLayer, and the hand-off from `cache.update` to attention.

The model calls `cache.update(k, v, layer_idx)` and then the attention function. `on_update` records
what this step's attention needs (the held K/V the update returned, the query length) and marks the
layer as the one the next attention call serves; the `kvcompress` attention (kvcompress.integration)
picks it up, computes attention over what the layer keeps and calls the policy. A sparse layer
updated twice without that attention in between means the model runs another attention
implementation: that raises an error naming `kvcompress.enable(model)`.

Held tokens stay in position order. `pos` [B, H, held] is each held token's position (None while
nothing was evicted: then the positions are 0..held-1; -1 on a dead slot, which a padded batch's row
evicted while another row still needed the slot, masked like padding); `scores` [B, H, held] is H2O's accumulated
attention, `log_size` [B, H, held] the log of how many tokens each held token stands for once H2O
merged evictions (kvcompress.sparse.merge). Quest's page summaries are `page_min` / `page_max`
[B, H, pages, D] in bfloat16, computed from the full-precision keys as each page of `page_size` tokens
completes and rounded outward (the min down, the max up), so each box still contains every key of its
page. In bfloat16 they take half the memory and half the bandwidth of float32 summaries; every decode
step reads all of them. With `unread_means` each page also keeps the mean of its values, `page_means`
[B, H, pages, Dv] in bfloat16 (kvcompress.sparse.unread).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from kvcompress.config import ConfigError
from kvcompress.sparse.base import SparsePolicy, gather_tokens

_local = threading.local()


@dataclass
class StepInputs:
    """What one attention call over a sparse layer reads.

    keys/values: [B, H, held, D]; mask: [B, H, q, held] (True = attend).
    """

    keys: torch.Tensor
    values: torch.Tensor
    q_len: int
    mask: torch.Tensor | None = None
    index: torch.Tensor | None = None  # [B, H, n] held tokens read (Quest; -1: a slot reading nothing), None = all
    mass_queries: int = 0  # newest queries whose attention is summed per token (0: no mass)
    scaling: float = 1.0  # the attention's logit scale (Quest scores pages on that scale)
    exact: tuple[int, int] = (0, 0)  # exact sink and tail tokens of a quantized layer, which every step reads


class SparseState:
    def __init__(self, policy: SparsePolicy, layer_idx: int):
        self.policy = policy
        self.layer_idx = layer_idx
        self.reset()

    def reset(self) -> None:
        self.pos: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.log_size: torch.Tensor | None = None  # H2O merge: log of the tokens each held token stands for
        self.page_min: torch.Tensor | None = None
        self.page_max: torch.Tensor | None = None
        self.page_means: torch.Tensor | None = None  # Quest's unread_means: each page's mean value
        self.pending_keys: torch.Tensor | None = None
        self.pending_values: torch.Tensor | None = None
        self.step: StepInputs | None = None
        # [B] padding slots each row has, counted by the policies that evict on steps of several tokens (a
        # prefill's padding; a decode token counts as real), so a decode step adds no work on the device
        self.pad: torch.Tensor | None = None
        # the most padding any row has (host int), so the cheap check "no row can be over budget" needs no sync
        self.pad_max = 0
        self.read_held = 0  # tokens held at the last step
        # the last step's selection [B, H, n] (None: everything) and the packed body's (first, count) then;
        # counted only when asked (bytes_read_last_step), so the decode step never waits on the device
        self.read_index: torch.Tensor | None = None
        self.read_body: tuple[int, int] = (0, 0)
        self.policy.reset()

    @property
    def read_index(self) -> torch.Tensor | None:
        """The last step's selection [B, H, n] (None: everything); a decode graph's Quest layer sets a function
        that builds it only when asked (kvcompress.graph.static_quest)."""
        index = self._read_index
        return index() if callable(index) else index

    @read_index.setter
    def read_index(self, index) -> None:
        self._read_index = index

    @property
    def tokens_read(self) -> float:
        """Tokens per (row, kv head) the last step read, on average (0 before any step)."""
        if self.read_index is None:
            return float(self.read_held)  # a host int, or a device scalar (per-kv-head budgets' mean count)
        if getattr(self.policy, "pads_selection", False):
            return float((self.read_index >= 0).sum(-1).float().mean())
        return self.read_index.shape[-1]

    # -- the hand-off --------------------------------------------------------------------------
    def on_update(self, layer, new_keys: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  new_values: torch.Tensor | None = None) -> None:
        """new_keys / new_values: [B, H, q, D] full precision; keys / values: [B, H, held, D], what update
        returns."""
        waiting = getattr(_local, "pending", None)
        if waiting is not None:
            _local.pending = None
            raise ConfigError(
                f"layer {waiting.layer_idx} uses the sparsity policy {type(waiting.sparse.policy).__name__}, "
                "which needs the query and attention weights of the kvcompress attention, but the model ran "
                "another attention implementation. Call `kvcompress.enable(model)` first (or run inside "
                "`with kvcompress.enabled(model): ...`)."
            )
        q = new_keys.shape[2]
        if self.pos is not None:
            seen = layer.cumulative_length
            new_pos = torch.arange(seen - q, seen, dtype=self.pos.dtype, device=self.pos.device)
            new_pos = new_pos.expand(*self.pos.shape[:2], q)
            self.pos = torch.cat([self.pos, new_pos], dim=2)
        if self.policy.keeps_page_summaries:
            self._summarize(new_keys, new_values if self.policy.unread_means else None)
        self.step = StepInputs(keys=keys, values=values, q_len=q)
        _local.pending = layer

    def count_padding(self, valid: torch.Tensor, q: int) -> None:
        """Add a step's padding to `pad` (valid [B, H, held] of its last query, the q new ones last); a decode
        step (q == 1) has none."""
        if q == 1:
            return
        new = q - valid[:, 0, valid.shape[-1] - q:].sum(-1)
        self.pad = new if self.pad is None else self.pad + new
        self.pad_max = int(self.pad.max())

    def seen_rows(self, seen_slots: int, like: torch.Tensor) -> torch.Tensor:
        """[B] real tokens each row has seen: the slots seen (the layer's cumulative length) less its padding."""
        if self.pad is None:
            return torch.full((like.shape[0],), seen_slots, dtype=torch.long, device=like.device)
        return seen_slots - self.pad

    def least_seen(self, seen_slots: int) -> int:
        """A lower bound on the real tokens any row has seen, without reading the device: the slots seen less
        the most padding a row has."""
        return seen_slots - self.pad_max

    def kill(self, dead: torch.Tensor) -> None:
        """Mask held slots dead [B, H, held] from now on (position -1): a padded batch's row evicted them
        while another row still needs the slot."""
        self.pos = self.pos.masked_fill(dead, -1)  # unconditional: testing dead.any() would wait on the device

    def positions(self, held: int, like: torch.Tensor) -> torch.Tensor:
        """[B, H, held] positions of the held tokens."""
        if self.pos is not None:
            return self.pos
        return torch.arange(held, device=like.device).expand(*like.shape[:2], held)

    def gather(self, idx: torch.Tensor, held: int) -> None:
        """Of `held` tokens the layer kept idx [B, H, n] (sorted): keep their positions (int32: half the bytes
        of int64 for every held token, and 2^31 positions) and scores."""
        self.pos = self.positions(held, idx).gather(2, idx).to(torch.int32)
        if self.scores is not None:
            self.scores = self.scores.gather(2, idx)

    # -- Quest page summaries -----------------------------------------------------------------
    def _summarize(self, new_keys: torch.Tensor, new_values: torch.Tensor | None) -> None:
        """Append min/max summaries of each page that completes (and its mean value, when new_values is
        given); keep the partial page's keys (and values)."""
        pages, self.pending_keys = complete_pages(self.pending_keys, new_keys, self.policy.page_size)
        if pages is not None:
            mn, mx = page_boxes(pages)
            self.page_min = append_pages(self.page_min, mn)
            self.page_max = append_pages(self.page_max, mx)
        if new_values is not None:
            pages, self.pending_values = complete_pages(self.pending_values, new_values, self.policy.page_size)
            if pages is not None:
                self.page_means = append_pages(self.page_means, pages.mean(3).to(torch.bfloat16))

    # -- batch edits and accounting ----------------------------------------------------------
    def map_batch(self, fn) -> None:
        for name in ("pos", "scores", "log_size", "page_min", "page_max", "page_means", "pending_keys",
                     "pending_values", "pad"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def tensors(self) -> list[torch.Tensor]:
        """Tensors held beside the K/V (positions, scores, page summaries): metadata for the memory report."""
        names = ("pos", "scores", "log_size", "page_min", "page_max", "page_means", "pending_keys",
                 "pending_values")
        return [getattr(self, n) for n in names if getattr(self, n) is not None]


def complete_pages(pending: torch.Tensor | None, new: torch.Tensor, p: int):
    """The tokens waiting for their page (pending [B, H, w, D] float32, or None) and new ones [B, H, q, D] ->
    (the pages they complete [B, H, n, P, D] float32, or None; the tokens still waiting)."""
    x = new.float() if pending is None else torch.cat([pending, new.float()], 2)
    n = x.shape[2] // p * p
    pages = x[:, :, :n].reshape(*x.shape[:2], n // p, p, x.shape[3]) if n else None
    return pages, x[:, :, n:].clone()


def page_boxes(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pages [B, H, n, P, D] float32 keys -> each page's (min, max) [B, H, n, D] bfloat16, rounded outward (the
    min down, the max up), so each box contains every key of its page."""
    return bf16_outward(pages.amin(3), down=True), bf16_outward(pages.amax(3), down=False)


def append_pages(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Per-page summaries [B, H, pages, D] with new ones appended along the pages."""
    return new if held is None else torch.cat([held, new], 2)


def bf16_outward(x: torch.Tensor, down: bool) -> torch.Tensor:
    """float32 x -> the nearest bfloat16 <= x (down) or >= x (up), by truncating the float32 bits (toward
    zero) and stepping one bfloat16 ulp away from zero where that went the wrong way and dropped bits."""
    bits = x.float().contiguous().view(torch.int32)
    kept = bits & -65536  # 0xFFFF0000: the bfloat16 toward zero
    inexact = (bits & 0xFFFF) != 0
    away = inexact & ((bits < 0) if down else (bits >= 0))  # toward zero went up (down) for x < 0 (x > 0)
    kept = kept + away.to(torch.int32) * 65536  # sign-magnitude: +1 ulp of magnitude
    return (kept >> 16).to(torch.int16).view(torch.bfloat16)


def take_pending(key: torch.Tensor):
    """The layer whose update returned `key` and awaits its attention (clears the mark), or None."""
    layer = getattr(_local, "pending", None)
    if layer is None or layer.sparse.step is None or layer.sparse.step.keys is not key:
        return None
    _local.pending = None
    return layer


def clear_pending() -> None:
    _local.pending = None


def attach_layer_sparsity(layer):
    """Give one CompressedLayer the SparseState of its policy's sparsity (None where it stays dense: no
    sparsity, or a layer below the spec's `dense_layers`); returns the layer's SparsePolicy or None."""
    from kvcompress.sparse import make_policy

    policy = make_policy(layer.policy.sparsity, layer.layer_idx)
    if policy is not None and policy.unread_means and getattr(layer, "mla_latent", False):
        raise ConfigError(
            f"layer {layer.layer_idx} is an MLA latent layer: Quest's unread_means (a mean value per page) "
            "is built for GQA layers only; drop unread_means=True for this model")
    layer.sparse = SparseState(policy, layer.layer_idx) if policy is not None else None
    return policy


def attach_sparsity(cache) -> None:
    """Give each CompressedLayer whose policy has sparsity (past its `dense_layers`) a SparseState."""
    from kvcompress.sparse.quest import LayerAllocator

    shared = []
    for layer in cache.layers:
        spec = getattr(getattr(layer, "policy", None), "sparsity", None)
        if spec is None:
            continue
        policy = attach_layer_sparsity(layer)
        if policy is not None and getattr(policy, "budget_sharing", "none") == "layers":
            shared.append((layer.layer_idx, spec))
    if shared:  # the Quest layers sharing the step's pages: one allocator, the same budget in each
        first = replace(shared[0][1], dense_layers=0)
        if any(replace(spec, dense_layers=0) != first for _, spec in shared):
            raise ConfigError("Quest layers with budget_sharing='layers' must share one budget, ratio and page size")
        allocator = LayerAllocator([i for i, _ in shared])
        for layer in cache.layers:
            if getattr(layer, "sparse", None) is not None and layer.layer_idx in allocator.layers:
                layer.sparse.policy.allocator = allocator


def gather_step(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K [B, H, n, Dk], V [B, H, n, Dv] and mask [B, H, q, n] this step reads (padding slots masked)."""
    if step.index is None:
        return step.keys, step.values, step.mask
    read = step.index >= 0  # [B, H, n]; -1 pads a head that reads fewer tokens than another
    idx = step.index.clamp_min(0)
    mask = step.mask.gather(3, idx[:, :, None, :].expand(-1, -1, step.mask.shape[2], -1)) & read[:, :, None]
    return gather_tokens(step.keys, idx), gather_tokens(step.values, idx), mask


def body_tokens_read(state) -> float | None:
    """Tokens of the layer's body (packed pages; all it holds when uncompressed) that the last step's
    selection read, per (row, kv head) on average (padding slots, -1, read nothing); None when the step
    read everything."""
    if state.read_index is None:
        return None
    first, n_body = state.read_body
    inside = (state.read_index >= first) & (state.read_index < first + n_body)
    return float(inside.sum(-1).float().mean())


def tokens_read(cache) -> float:
    """Tokens per kv head the last step read, averaged over the layers holding any (Quest reads a subset)."""
    counts = []
    for layer in cache.layers:
        held = getattr(layer, "held_tokens", 0)
        if not held:
            continue
        sparse = getattr(layer, "sparse", None)
        counts.append(sparse.tokens_read if sparse is not None and sparse.tokens_read else held)
    return sum(counts) / len(counts) if counts else 0.0
