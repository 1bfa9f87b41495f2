"""Per-kv-head budgets held for real: each (row, kv head) keeps its own number of tokens, packed.

With `SparsitySpec.head_shares` an H2O layer's kv heads keep different numbers of tokens (a calibrated
head that spreads its attention keeps more than one that reads a few tokens). Padding every head to the
largest count would hold the difference as dead slots; here the full-precision tokens each (row, kv head)
keeps after an eviction are packed back to back (`RaggedHeads`): K [M, Dk], V [M, Dv] with M the sum of
the kept counts, and the counts [B, H]. The tokens that arrive until the next eviction (at most the
policy's slack) join the layer's ordinary tail [B, H, n, D], where every head has the same count.

The fused kernel reads the packed tokens in place, each head from its own offset
(kvcompress.kernels.parts.ragged_parts); the torch attention reads the padded view [B, H, width, D]
(`padded`, each head's tokens first, zeros after), rebuilt for each step and freed after it, as a Quest
step's gathered tokens are. The layer's SparseState keeps `pos` / `scores` in that padded order, the slots
past a head's count dead (position -1), which the kernel scores as never read. An eviction gathers what each
head keeps straight from the packed tokens and the tail (`_kept_packed`), without a padded view.

Hand-rolled rather than torch.nested: a boolean mask over [B, H, width] packs and unpacks in one indexing
op each, on any device and dtype, and the rest of the layer keeps plain tensors.
"""

from __future__ import annotations

import torch

from kvcompress.sparse.base import hold_tokens, keep_key


class RaggedHeads:
    """The tokens each (row, kv head) keeps, packed: keys [M, Dk], values [M, Dv], counts [B, H]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor):
        """keys / values: [B, H, width, D] with each head's counts[b, h] tokens first (the rest ignored)."""
        self._counted(counts, keys.shape[2])
        live = self.live()
        self.keys, self.values = keys[live], values[live]  # boolean indexing copies: the padded input is freed

    @classmethod
    def from_packed(cls, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, width: int) -> RaggedHeads:
        """keys [M, Dk] / values [M, Dv] already packed by row then head, counts [B, H], width their largest."""
        self = cls.__new__(cls)
        self._counted(counts, width)
        self.keys, self.values = keys, values
        return self

    def _counted(self, counts: torch.Tensor, width: int) -> None:
        self.shape = (*counts.shape, width)
        self.counts = counts
        flat = counts.flatten()
        self.offsets = (flat.cumsum(0) - flat).view(counts.shape)  # [B, H]: where each head's tokens start

    @property
    def width(self) -> int:
        """Slots per (row, kv head) of the padded view: the largest count."""
        return self.shape[2]

    def live(self) -> torch.Tensor:
        """[B, H, width] True on each head's kept tokens."""
        return torch.arange(self.width, device=self.counts.device) < self.counts[..., None]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K [B, H, width, Dk], V [B, H, width, Dv]: each head's tokens first, zeros after."""
        live = self.live()
        out = []
        for x in (self.keys, self.values):
            full = x.new_zeros(self.shape + x.shape[1:])
            full[live] = x
            out.append(full)
        return out[0], out[1]

    def mean_count(self) -> torch.Tensor:
        """Tokens a (row, kv head) keeps on average (a device scalar)."""
        return self.counts.float().mean()

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.counts, self.offsets]

    def map_batch(self, fn) -> RaggedHeads:
        """The same rows mapped by fn (reorder, repeat, select, move) over [B, ...] tensors."""
        k, v = self.padded()
        return RaggedHeads(fn(k), fn(v), fn(self.counts))


def evict_heads(layer, state, priority: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor,
                budgets: torch.Tensor, slack: int) -> None:
    """Evict each (row, kv head) down to its own budget where its real tokens exceed budget + slack, and pack
    what every head keeps (RaggedHeads) into `layer.ragged`, the tail emptied.

    priority, forced, valid: [B, H, held] over the layer's padded view (ragged part, then tail);
    budgets: [B, H] tokens each head may keep.
    """
    real = valid.sum(-1)  # [B, H]
    over = real > budgets + slack
    if not bool(over.any()):
        return
    must = (forced & valid).sum(-1)
    keep = torch.where(over, torch.maximum(budgets, must), real)  # [B, H]
    held, width = valid.shape[-1], int(keep.max())
    order = keep_key(priority, forced, valid).topk(width, dim=-1).indices  # [B, H, width], best first
    live = torch.arange(width, device=order.device) < keep[..., None]
    # each head's kept tokens in position order, then its dead slots (pointing at slot 0, masked)
    idx = torch.where(live, order, held).sort(dim=-1).values.masked_fill(~live, 0)
    keys, values = _kept_packed(layer, idx, live)
    layer.ragged = RaggedHeads.from_packed(keys, values, keep, width)
    hold_tokens(layer, layer.tail_k[:, :, :0].clone(), layer.tail_v[:, :, :0].clone())
    state.gather(idx, held)
    state.kill(~live)


def _kept_packed(layer, idx: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The held tokens at idx [B, H, w] (in the padded order: each head's packed tokens, then the tail) where
    live [B, H, w], packed by row then head: keys [M, Dk], values [M, Dv], read from the packed tokens and
    the tail directly (no padded view of the layer is built, as one per eviction would be several copies of
    the largest head's size)."""
    b, h, _ = torch.nonzero(live, as_tuple=True)  # waits on the device once, as the packing did
    i = idx[live]
    old = layer.ragged
    width = old.width if old is not None else 0
    out = []
    for packed, tail in ((None if old is None else old.keys, layer.tail_k),
                         (None if old is None else old.values, layer.tail_v)):
        x = None
        if tail.shape[2]:
            x = tail[b, h, (i - width).clamp(0, tail.shape[2] - 1)]
        if packed is not None:
            from_packed = packed[(old.offsets[b, h] + i).clamp(max=max(packed.shape[0] - 1, 0))]
            x = from_packed if x is None else torch.where((i < width)[:, None], from_packed, x)
        out.append(x)
    return out[0], out[1]
