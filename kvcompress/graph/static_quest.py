"""Quest's page selection at fixed addresses, for a quantized layer held by a decode graph.

The growing layer's Quest step (`QuestPolicy.select`) scores the pages it holds and takes the top k, where
the pages held and k change with the tokens; a captured step reads fixed shapes only, so:
- the page summaries live in buffers sized for the body's room, `page_min` / `page_max` [B, H, Sp + C, D]
  bfloat16 (Sp sink pages, then C body pages); the host writes a page's box when the page moves from the
  tail into the body (`flush`, from `StaticLayer`), from the same full-precision keys and rounded outward as
  the growing layer's (`kvcompress.sparse.state.page_boxes`);
- the pages held (`n_pages`) and the pages this step takes (`k`) are [1] integers on the device that the host
  updates between replays (`prepare`, host integers only);
- in the step (`select`, captured): every page of the buffers is scored (`quest_page_scores`; pages past
  `n_pages` not valid), the sink pages and the first page forced in as the growing layer forces them, the
  top `k_max` taken by score and the ranks from `k` on dropped: the growing layer's top k. The kernel's page
  list is the body pages among them ([B, H, k_max], ascending, -1 for none or a sink page: the kernel reads
  the exact sinks and the exact tail anyway, as in the growing layer).
Nothing is evicted. `selected` keeps the step's pages (held-page indices, ascending, past the k-th a value
that sorts last) for the read accounting (`read_index`).
"""

from __future__ import annotations

import torch

from kvcompress.config import ConfigError
from kvcompress.sparse.state import page_boxes

_NONE = torch.iinfo(torch.int32).max  # a dropped rank: sorts after every page


def static_quest_supported(layer) -> bool:
    """Whether a decode graph can hold this sparse layer: Quest over quantized pages of a GQA layer whose decode
    steps the fused kernel reads with a page list (`fused_supported`: Quest pages = the body's pages, whole sink
    pages, no page means), k pages for every kv head (no budget sharing)."""
    from kvcompress.kernels.attention_backend import fused_supported
    from kvcompress.sparse.quest import QuestPolicy

    sparse = getattr(layer, "sparse", None)
    if sparse is None or not getattr(layer, "compressed", False) or getattr(layer, "mla_latent", False):
        return False
    policy = sparse.policy
    return type(policy) is QuestPolicy and policy.budget_sharing == "none" and fused_supported(layer)


class StaticQuest:
    def __init__(self, layer, room: int, max_tokens: int):
        """room: body tokens the reserved buffers hold (C * P); max_tokens: the most tokens the graph sees."""
        if not static_quest_supported(layer):
            raise ConfigError(f"layer {layer.layer_idx}: a decode graph holds Quest layers over quantized pages "
                              "(pages of the body's size, no budget sharing, no page means) only")
        state, p = layer.sparse, layer.key_store.page_size
        b, h, _, d = layer.tail_k.shape
        self.page, self.sink_pages = p, layer.sink_k.shape[2] // p
        n_max = self.sink_pages + room // p
        held = (layer.sink_k.shape[2] + layer.key_store.n_tokens) // p
        if state.page_min is None or state.page_min.shape[2] < held:
            raise ConfigError(f"layer {layer.layer_idx}: Quest has no summary for some held page; decode eagerly "
                              "until it does")
        dev = layer.tail_k.device
        self.page_min = torch.zeros(b, h, n_max, d, dtype=torch.bfloat16, device=dev)
        self.page_max = torch.zeros_like(self.page_min)
        self.page_min[:, :, :held] = state.page_min[:, :, :held]
        self.page_max[:, :, :held] = state.page_max[:, :, :held]
        self.n_pages = torch.tensor([held], dtype=torch.int64, device=dev)
        # the most pages a step takes: the budget at max_tokens less the one tail token every step reads
        self.k_max = max(1, min(n_max, (state.policy.token_budget(max_tokens) - 1) // p))
        self.k_host = -1
        self.k = torch.zeros(1, dtype=torch.int64, device=dev)
        self.selected = torch.zeros(b, h, self.k_max, dtype=torch.int32, device=dev)
        self.radius = state.policy.radius_scale
        state.page_min, state.page_max, state.pending_keys = self.page_min, self.page_max, None

    # -- inside the step (captured) ---------------------------------------------------------------
    def select(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [B, Hq, D] -> the kernel's page list [B, H, k_max] int32 (body pages ascending, -1: none)."""
        from kvcompress.kernels.quest import quest_page_scores

        n_max = self.page_min.shape[2]
        valid = (torch.arange(n_max, device=query.device) < self.n_pages).view(1, 1, n_max)
        score = quest_page_scores(query, self.page_min, self.page_max, valid, scaling=scaling,
                                  radius_scale=self.radius)  # [B, H, n_max], -inf past the pages held
        forced = max(self.sink_pages, 1)  # the sink pages and the first page (attention sinks)
        score[..., :forced] = float("inf")
        top = score.topk(self.k_max, dim=-1)  # [B, H, k_max] in decreasing score
        rank = torch.arange(self.k_max, device=query.device)
        keep = (rank < self.k) & (top.values > float("-inf"))
        sel = torch.where(keep, top.indices.to(torch.int32), _NONE).sort(-1).values
        self.selected.copy_(sel)
        body = sel - self.sink_pages
        return torch.where((sel != _NONE) & (body >= 0), body, -1)

    # -- on the host, between replays ----------------------------------------------------------------
    def held_pages(self, layer) -> int:
        """Pages the layer holds in its sinks and body (the candidates; the tail is read whole)."""
        return (layer.sink_k.shape[2] + layer.key_store.n_tokens) // self.page

    def flush(self, keys: torch.Tensor, layer) -> None:
        """keys [B, H, P, D]: the page about to become the layer's next body page (full precision): write its box
        (the buffers hold the body's whole reservation, which StaticLayer checked)."""
        i = self.held_pages(layer)
        mn, mx = page_boxes(keys.float()[:, :, None])
        self.page_min[:, :, i : i + 1] = mn
        self.page_max[:, :, i : i + 1] = mx
        self.n_pages.fill_(i + 1)

    def prepare(self, layer, n_tail: int) -> None:
        """Set k for the next step, which will hold one more token, n_tail + 1 of them in the tail: the growing
        layer's k, min((budget - tail) // P, candidate pages) (kvcompress.sparse.quest.QuestPolicy.select)."""
        policy = layer.sparse.policy
        budget = policy.token_budget(layer.cumulative_length + 1)
        k = min(max((budget - n_tail - 1) // self.page, 0), self.held_pages(layer), self.k_max)
        if k != self.k_host:
            self.k_host = k
            self.k.fill_(k)

    def ran(self, layer, n_tail: int) -> None:
        """Account for the step that ran (holding n_tail tail tokens): the layer's SparseState tells what it read
        as the growing layer's does (tokens_read, bytes_read_last_step), its index built only when asked."""
        held = layer.sink_k.shape[2] + layer.key_store.n_tokens + n_tail
        state, read = layer.sparse, (self.k_host, held, n_tail)
        state.read_held, state.read_index = held, lambda: self.read_index(*read)
        state.read_body = (layer.sink_k.shape[2], layer.key_store.n_tokens)

    def read_index(self, k: int, held: int, tail: int) -> torch.Tensor:
        """The held-token index [B, H, k * P + tail] of a step that took k pages, holding `held` tokens, `tail`
        of them in the exact tail: the growing layer's selection. Reads `selected`: the last step's."""
        p = self.page
        arange = torch.arange(p, device=self.selected.device)
        pages = (self.selected[..., :k, None].long() * p + arange).flatten(2)
        last = torch.arange(held - tail, held, device=pages.device).expand(*pages.shape[:2], tail)
        return torch.cat([pages, last], -1)

    def release(self, layer, tail_k: torch.Tensor) -> None:
        """Give the layer's SparseState summaries of every complete page and the keys of the partial one (the
        tail's, tail_k [B, H, T, D]), as the growing layer keeps them."""
        from kvcompress.sparse.state import complete_pages

        state, held = layer.sparse, self.held_pages(layer)
        pages, state.pending_keys = complete_pages(None, tail_k, self.page)
        mn, mx = self.page_min[:, :, :held].clone(), self.page_max[:, :, :held].clone()
        if pages is not None:
            t_mn, t_mx = page_boxes(pages)
            mn, mx = torch.cat([mn, t_mn], 2), torch.cat([mx, t_mx], 2)
        state.page_min, state.page_max = mn, mx
