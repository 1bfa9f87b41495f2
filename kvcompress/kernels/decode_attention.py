"""Decode attention over a compressed layer: one new query token against sinks | packed body | tail.

`decode_attention_torch` is the pure-torch twin of `decode_attention_triton`
(kvcompress.kernels.decode_attention_triton): same signature, same result up to rounding. The torch
one decodes the packed body with the codec (only the listed pages when a page list is given) and
runs plain fp32 attention; it is the CPU path and the oracle of the tests. `decode_attention` picks
one by `kvcompress.kernels.select_backend()`.

Shapes: q [B, Hq, Dk] (one token per sequence), Hq a multiple of Hkv (GQA: query heads h*G .. h*G+G-1
read kv head h); out [B, Hq, Dv]; page_list [B, Hkv, n_sel] page indices of the body (entries < 0 or
>= n_pages are skipped; sinks and tail are always read: Quest); probs (H2O) [B, Hkv, S + N + T]: the
attention probability of every held position summed over the group's query heads (0 where not read).
"""

from __future__ import annotations

import torch

from kvcompress.kernels.parts import AttentionParts, layer_parts


def decode_attention_torch(
    q: torch.Tensor,
    parts: AttentionParts,
    scaling: float,
    page_list: torch.Tensor | None = None,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference decode attention. Returns (out [B, Hq, Dv] in q.dtype, probs [B, Hkv, S+N+T] fp32 or None)."""
    b, hq, _ = q.shape
    hkv = parts.kv_heads
    _check_heads(hq, hkv)
    dtype = parts.tail_k.dtype
    n_sink, n_body, n_tail = parts.n_sinks, parts.n_body, parts.n_tail
    dev = q.device

    keys, values, valid, positions = [parts.sink_k], [parts.sink_v], [], []
    valid.append(torch.ones(b, hkv, n_sink, dtype=torch.bool, device=dev))
    positions.append(torch.arange(n_sink, device=dev).expand(b, hkv, n_sink))
    if parts.key is not None:
        k_body, v_body, tok, ok = _body(parts, page_list, dtype)
        keys.append(k_body)
        values.append(v_body)
        valid.append(ok)
        positions.append(n_sink + tok.clamp(0, max(n_body - 1, 0)))
    keys.append(parts.tail_k)
    values.append(parts.tail_v)
    tail_ok = torch.ones(b, hkv, n_tail, dtype=torch.bool, device=dev)
    if parts.tail_lengths is not None:  # a fixed-size tail buffer: only its first tail_lengths tokens are held
        tail_ok = tail_ok & (torch.arange(n_tail, device=dev) < parts.tail_lengths.to(dev))
    valid.append(tail_ok)
    positions.append(n_sink + n_body + torch.arange(n_tail, device=dev).expand(b, hkv, n_tail))

    k = torch.cat(keys, 2).float()  # [B, Hkv, n, Dk]
    v = torch.cat(values, 2).float()  # [B, Hkv, n, Dv]
    ok = torch.cat(valid, 2)  # [B, Hkv, n]
    if parts.row_starts is not None:  # left padding: positions before the row's start
        ok = ok & (torch.cat(positions, 2) >= parts.row_starts.to(dev).view(b, 1, 1))
    qg = q.float().reshape(b, hkv, hq // hkv, -1)  # [B, Hkv, G, Dk]
    s = torch.einsum("bhgd,bhnd->bhgn", qg, k) * scaling
    s = s.masked_fill(~ok[:, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1)  # [B, Hkv, G, n]
    out = torch.einsum("bhgn,bhnd->bhgd", p, v).reshape(b, hq, -1).to(q.dtype)
    if not return_probs:
        return out, None
    probs = torch.zeros(b, hkv, parts.n_positions, dtype=torch.float32, device=dev)
    probs.scatter_add_(2, torch.cat(positions, 2), p.sum(2).masked_fill(~ok, 0.0))
    return out, probs


def _body(parts: AttentionParts, page_list: torch.Tensor | None, dtype: torch.dtype):
    """Decoded body K, V [B, Hkv, n, D], the body token index of each [B, Hkv, n] and whether it is read."""
    key, value = parts.key, parts.value
    b, hkv, dev = parts.batch, parts.kv_heads, parts.tail_k.device
    if parts.body_offsets is not None:  # packed by (row, kv head), each head from its offset (parts.ragged_parts)
        tok = torch.arange(key.n_tokens, device=dev).expand(b, hkv, -1)
        ok = tok < parts.body_lengths.to(dev)[..., None]
        at = (parts.body_offsets.to(dev)[..., None] + tok).masked_fill(~ok, 0)[..., None]  # [B, Hkv, n, 1]
        first = {name: t[:1, :1] for name, t in key.data.items()}, {name: t[:1, :1] for name, t in value.data.items()}
        k, v = (s.codec.decode(f, s.row, dtype).expand(b, hkv, -1, -1) for s, f in zip((key, value), first))
        k, v = k.gather(2, at.expand(-1, -1, -1, k.shape[-1])), v.gather(2, at.expand(-1, -1, -1, v.shape[-1]))
        return k, v, tok, ok
    if page_list is None:
        k, v = key.decode(dtype), value.decode(dtype)
        tok = torch.arange(key.n_tokens, device=dev).expand(b, hkv, -1)
        ok = torch.ones_like(tok, dtype=torch.bool)
    else:
        pl = page_list.to(dev).long()  # [B, Hkv, n_sel]
        page_ok = (pl >= 0) & (pl < key.n_pages)
        pl = torch.where(page_ok, pl, torch.zeros_like(pl))
        k, v = key.decode_pages(pl, dtype), value.decode_pages(pl, dtype)
        p = key.page_size
        tok = (pl[..., None] * p + torch.arange(p, device=dev)).flatten(2)  # [B, Hkv, n_sel*P]
        ok = page_ok[..., None].expand(-1, -1, -1, p).flatten(2)
    if parts.body_lengths is not None:
        ok = ok & (tok < parts.body_lengths.to(dev).view(b, 1, 1))
    return k, v, tok, ok


def _check_heads(hq: int, hkv: int) -> None:
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")


def decode_attention(
    q: torch.Tensor,
    parts: AttentionParts,
    scaling: float,
    page_list: torch.Tensor | None = None,
    return_probs: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention by the selected backend (`select_backend(q.device)` unless `backend` is given).

    Codecs the fused kernel does not read (e.g. bitsandbytes) take the torch path on every backend.
    """
    from kvcompress.kernels.backend import select_backend

    backend = backend or select_backend(q.device)
    if backend == "triton" and _fused_supports(parts):
        from kvcompress.kernels.decode_attention_triton import decode_attention_triton

        return decode_attention_triton(q, parts, scaling, page_list, return_probs)
    return decode_attention_torch(q, parts, scaling, page_list, return_probs)


def _fused_supports(parts: AttentionParts) -> bool:
    from kvcompress.kernels.streams import stream_supported

    return parts.key is None or (stream_supported(parts.key.codec) and stream_supported(parts.value.codec))


def layer_decode_attention(
    layer,
    q: torch.Tensor,
    scaling: float,
    page_list: torch.Tensor | None = None,
    return_probs: bool = False,
    body_lengths: torch.Tensor | None = None,
    backend: str | None = None,
    row_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention of q [B, Hq, D] over a `CompressedLayer`'s held tokens (see `decode_attention`);
    row_starts [B]: left padding, the first held position each row attends to."""
    return decode_attention(q, layer_parts(layer, body_lengths, row_starts), scaling, page_list, return_probs,
                            backend)
