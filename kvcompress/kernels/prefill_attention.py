"""Prefill attention over a compressed layer, a block of held tokens at a time.

A prefill chunk (q > 1 new tokens) attends to everything the layer holds. Decoding the whole body and
handing it to SDPA (what the drop-in path does) holds a dense copy of the layer's cache, and
transformers' SDPA then repeats K/V for every query head of a GQA group: at 32K tokens x batch 8 of a
Llama-8B layer that is 1 GB + 4 GB, which caps the longest prompt far below what the compressed cache
itself would allow. Here the layer's parts (sinks | body pages | tail) are read in blocks of whole
pages, each block decoded, scored and dropped, with an online softmax in float32; the query rows of a
GQA group share their kv head's block (never repeated). Transient memory is bounded by `budget` score
elements, whatever the context.

Shapes: query [B, Hq, q, Dk] holds the newest q held positions (the chunk just appended), Hq a multiple
of Hkv (query heads h*G .. h*G+G-1 read kv head h); out [B, Hq, q, Dv] in query.dtype. chunk: the
chunk's own K [B, Hkv, q, Dk] and V [B, Hkv, q, Dv] as computed; given, the chunk attends to them exactly
and to the tokens held before it as stored (what `CompressedLayer.update` returns for a prefill chunk);
None reads every position from the store. Causal: query
position i sees held positions <= i. row_starts [B]: left padding (positions before a row's start are
not attended; query rows that see nothing give 0).

Half-precision models: the scores and the weighted sum run as float32 matmuls with TF32 allowed, which
is exact for the scores (bf16 / fp16 inputs fit TF32's 10 mantissa bits) and rounds the probabilities to
10 bits (SDPA's flash kernel rounds them to the model dtype). float32 models stay in full float32.
"""

from __future__ import annotations

import contextlib

import torch

_BUDGET = {"cuda": 1 << 28, "cpu": 1 << 24}  # score elements per block (1 GB / 64 MB of float32)


def prefill_attention(
    query: torch.Tensor,
    layer,
    scaling: float,
    row_starts: torch.Tensor | None = None,
    budget: int | None = None,
    chunk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of the newest q held positions over a CompressedLayer's held tokens.

    query [B, Hq, q, Dk] -> [B, Hq, q, Dv]; budget: score elements per block (default by device); chunk:
    (K [B, Hkv, q, Dk], V [B, Hkv, q, Dv]) of the newest q positions, read instead of their stored form."""
    b, hq, q, _ = query.shape
    hkv = layer.sink_k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    held = layer.held_tokens
    if q > held:
        raise ValueError(f"{q} query tokens but the layer holds only {held}")
    g = hq // hkv
    dev = query.device
    rows = g * q
    budget = budget or _BUDGET.get(dev.type, _BUDGET["cpu"])
    page = layer.key_store.page_size
    # rows per pass and tokens per block: at least a page of tokens, whole pages in the body
    row_chunk = max(1, min(rows, budget // (b * hkv * max(page, 1024))))
    block = max(page, budget // (b * hkv * row_chunk) // page * page)

    qg = query.reshape(b, hkv, rows, -1)  # [B, Hkv, G*q, Dk]: row r is head h*G + r // q, position r % q
    q_pos = (held - q + torch.arange(q, device=dev)).repeat(g)  # [G*q]
    dv = layer.tail_v.shape[-1]
    m = torch.full((b, hkv, rows, 1), float("-inf"), device=dev)
    l = torch.zeros(b, hkv, rows, 1, device=dev)
    acc = torch.zeros(b, hkv, rows, dv, device=dev)
    starts = None if row_starts is None else row_starts.to(dev).view(b, 1, 1, 1)
    with _tf32(query.dtype):
        for k, v, first in _blocks(layer, block, held - q if chunk is not None else held, chunk):
            k, v = k.float(), v.float()
            k_pos = first + torch.arange(k.shape[2], device=dev)  # [n]
            for r0 in range(0, rows, row_chunk):
                r = slice(r0, r0 + row_chunk)
                s = torch.matmul(qg[:, :, r].float(), k.transpose(-1, -2)) * scaling  # [B, Hkv, R, n]
                ok = k_pos[None, :] <= q_pos[r, None]  # [R, n] causal
                if starts is not None:
                    ok = ok & (k_pos.view(1, 1, 1, -1) >= starts)  # [B, 1, R, n]
                s = s.masked_fill(~ok, float("-inf"))
                m_new = torch.maximum(m[:, :, r], s.amax(-1, keepdim=True))
                ref = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that see nothing yet
                p = torch.exp(s - ref)
                alpha = torch.exp(m[:, :, r] - ref)
                l[:, :, r] = l[:, :, r] * alpha + p.sum(-1, keepdim=True)
                acc[:, :, r] = acc[:, :, r] * alpha + torch.matmul(p, v)
                m[:, :, r] = m_new
    out = acc / l.clamp_min(torch.finfo(torch.float32).tiny)  # rows with l = 0 (padding) give 0
    return out.reshape(b, hq, q, dv).to(query.dtype)


def _blocks(layer, block: int, limit: int, chunk=None):
    """(K [B, H, n, Dk], V [B, H, n, Dv], position of the first) for the held positions below `limit` as
    stored (sinks, the body in blocks of `block` tokens decoded one block at a time, tail), then `chunk`
    (the positions from `limit` on, exact) when given."""
    for k, v, first in _stored_blocks(layer, block):
        if first >= limit:
            break
        n = min(k.shape[2], limit - first)
        yield k[:, :, :n], v[:, :, :n], first
    if chunk is not None:  # in blocks too: a whole prompt's chunk would overrun the score budget
        for i in range(0, chunk[0].shape[2], block):
            yield chunk[0][:, :, i:i + block], chunk[1][:, :, i:i + block], limit + i


def _stored_blocks(layer, block: int):
    """(K, V, position of the first) for the sinks, the body in blocks of `block` tokens (whole pages) and
    the tail, as stored."""
    n_sink = layer.sink_k.shape[2]
    if n_sink:
        yield layer.sink_k, layer.sink_v, 0
    page = layer.key_store.page_size
    pages = layer.key_store.n_pages
    step = max(1, block // page)
    for p0 in range(0, pages, step):
        p1 = min(pages, p0 + step)
        k = layer.key_store.decode_pages(p0, p1, layer.dtype)
        v = layer.value_store.decode_pages(p0, p1, layer.dtype)
        yield k, v, n_sink + p0 * page
    if layer.tail_k.shape[2]:
        yield layer.tail_k, layer.tail_v, n_sink + layer.key_store.n_tokens


@contextlib.contextmanager
def _tf32(dtype: torch.dtype):
    """TF32 matmuls for bf16 / fp16 models on CUDA (see the module doc), restored afterwards."""
    if dtype not in (torch.bfloat16, torch.float16) or not torch.cuda.is_available():
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
