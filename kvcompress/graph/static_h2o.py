"""H2O's scores and positions at fixed addresses, for a quantized layer held by a decode graph.

A captured step cannot run the policy's Python, so the work splits in two:
- in the step (captured): the fused kernel returns each held token's attention mass and the step adds it to
  `scores`, a buffer laid out as the kernel's probability vector over the static parts: sinks [S] | body
  room [C] | tail buffer [R + P] (slots past a part's length get no mass);
- on the host, between replays (`StaticLayer.advance`): a flushed page's scores move from the tail to the
  body (`flush`), and when the policy says a row may be over its budget (`H2OPolicy.due`, host integers
  only) the layer evicts as the growing layer does (`H2OPolicy.evict` over the held tokens in order, sinks |
  body | tail), the kept pages gathered to the front of the reserved buffers in place (`PagedStore.keep_pages`).
  That is once every page or so, as often as the growing layer evicts.

Positions: the sinks are the first S tokens and the tail the newest, so only the body's positions are kept,
`body_pos` [B, H, N] int32, replaced at flushes and evictions and never read by the step. While the graph
holds the layer, its SparseState's `scores` and `pos` are these two tensors (so the memory report counts
them); `release` puts the held-order tensors back.
"""

from __future__ import annotations

import torch

from kvcompress.config import ConfigError


def static_h2o_supported(layer) -> bool:
    """Whether a decode graph can hold this sparse layer: H2O over quantized pages of a GQA layer, with one
    budget for all its kv heads and evicted tokens dropped (not merged)."""
    from kvcompress.sparse.h2o import H2OPolicy

    sparse = getattr(layer, "sparse", None)
    if sparse is None or not getattr(layer, "compressed", False) or getattr(layer, "mla_latent", False):
        return False
    policy = sparse.policy
    return type(policy) is H2OPolicy and not policy.merge and not policy.head_shares


def h2o_room_pages(layer, max_tokens: int) -> int:
    """Body pages an H2O layer can hold up to `max_tokens` seen: the budget then, its sinks, the recent window's
    partial pages and the page of slack it grows by before evicting."""
    policy, page = layer.sparse.policy, layer.key_store.page_size
    tokens = policy.token_budget(max_tokens) + policy.sinks + layer.policy.residual
    return -(-tokens // page) + 4


class StaticH2O:
    def __init__(self, layer, room: int, tail_room: int):
        """room: body tokens the reserved buffers hold (C); tail_room: the static tail buffer's tokens."""
        if not static_h2o_supported(layer):
            raise ConfigError(f"layer {layer.layer_idx}: a decode graph holds H2O layers over quantized pages only")
        state = layer.sparse
        b, h = layer.tail_k.shape[:2]
        s, n, t = layer.sink_k.shape[2], layer.key_store.n_tokens, layer.tail_k.shape[2]
        self.sinks, self.room = s, room
        self.scores = torch.zeros(b, h, s + room + tail_room, dtype=torch.float32, device=layer.tail_k.device)
        if state.scores is not None:
            self.scores[..., : s + n] = state.scores[..., : s + n]
            self.scores[..., s + room : s + room + t] = state.scores[..., s + n :]
        pos = state.positions(s + n + t, layer.tail_k)
        self.body_pos = pos[..., s : s + n].to(torch.int32).contiguous()
        state.scores, state.pos = self.scores, self.body_pos

    def held(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores float32, positions int32), each [B, H, held], in held order (sinks | body | tail), as the
        growing layer keeps them."""
        s, n, t = self.sinks, layer.key_store.n_tokens, layer.tail_k.shape[2]
        b, h = self.scores.shape[:2]
        scores = torch.cat([self.scores[..., : s + n], self.scores[..., s + self.room : s + self.room + t]], -1)
        seen, dev = layer.cumulative_length, self.scores.device
        sink_pos = torch.arange(s, dtype=torch.int32, device=dev).expand(b, h, s)
        tail_pos = torch.arange(seen - t, seen, dtype=torch.int32, device=dev).expand(b, h, t)
        return scores, torch.cat([sink_pos, self.body_pos, tail_pos], -1)

    def flush(self, state, n_body: int, n_tail: int, page: int, seen: int) -> None:
        """The tail's oldest page (of n_tail tokens, `seen` seen) becomes body page n_body // page: move its
        scores and positions, shift the tail's scores, and clear the freed tail slots for the tokens to come."""
        s, c, sc = self.sinks, self.room, self.scores
        sc[..., s + n_body : s + n_body + page] = sc[..., s + c : s + c + page]
        rest = n_tail - page
        sc[..., s + c : s + c + rest] = sc[..., s + c + page : s + c + n_tail].clone()
        sc[..., s + c + rest : s + c + n_tail] = 0
        first = seen - n_tail
        new = torch.arange(first, first + page, dtype=torch.int32, device=sc.device)
        self.body_pos = torch.cat([self.body_pos, new.expand(*self.body_pos.shape[:2], page)], -1)
        state.pos = self.body_pos

    def evict(self, layer) -> bool:
        """Evict as the growing layer would after this step, when the policy says a row may be over budget.
        Returns whether it ran (the body's length changed)."""
        state = layer.sparse
        if not state.policy.due(layer, state, layer.held_tokens, 1):
            return False
        state.scores, state.pos = self.held(layer)
        valid = torch.ones(state.scores.shape, dtype=torch.bool, device=self.scores.device)  # no padding here
        state.policy.evict(layer, state, valid, 1)
        s, n = self.sinks, layer.key_store.n_tokens
        self.scores[..., : s + n] = state.scores[..., : s + n]
        self.scores[..., s + n : s + self.room] = 0
        self.body_pos = state.pos[..., s : s + n].contiguous()
        state.scores, state.pos = self.scores, self.body_pos
        return True

    def release(self, layer) -> None:
        """Give the layer's SparseState its held-order scores and positions back (a growing layer again)."""
        layer.sparse.scores, layer.sparse.pos = self.held(layer)
