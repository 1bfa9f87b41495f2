"""Non-uniform codebook quantization with dense-and-sparse outliers (KVQuant, arXiv:2401.18079;
TurboQuant, arXiv:2504.19874).

Each element is normalised, then coded as the index of the nearest of 2**b codebook levels:

- axis="channel" (keys): u = (x - mean_c) / scale_c, with per-channel statistics either calibrated
  (shared [H, D]) or measured on the tokens present at the first flush and then frozen (ROW fields).
- axis="page" (keys): per page and channel, the range [lo, hi] of the non-outlier elements, stored
  as scale = (hi - lo) / 2 and zero = (hi + lo) / 2 in fp16 or FP8 (page_range.py);
  u = (x - zero) / scale in [-1, 1].
  With calibrated `channel_widths` [H, D] (calib/widths.py) channel c takes its own number of bits
  (0..8, uniform levels on the page range; 0 keeps the page's zero), packed as one bit stream per token
  (pack_widths.py): channels whose rounding moves attention scores most get more of the same bits.
  Post-RoPE keys drift along the sequence, so a range per page follows them where frozen statistics
  cannot (measured on SmolLM2 keys: 27.6 dB against 21.0 dB for frozen per-channel statistics at
  4 bits, pages of 64, 1% outliers). The default codebook here is
  the uniform grid with both ends on the range (it measured better than Gaussian levels: the range ends
  hold the largest keys, which dominate attention scores); calibration fits non-uniform levels.
- axis="token" (values): u = x / rms_t, one fp16 scale per token and head.
- rotation: x is first rotated by a randomized Hadamard matrix (TurboQuant), which makes each
  coordinate near-Gaussian so one data-oblivious codebook fits.

Outliers: in each page of P tokens, the `outlier_fraction` of elements with the largest |u| are kept
exactly in a sparse side list (int16/int32 position within the page, fp16/bf16 value) and left out
of the statistics. Without calibration the codebook is the Gaussian Lloyd-Max one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvcompress.config import ConfigError
from kvcompress.quant.base import Codec, FieldKind, Role
from kvcompress.quant.codebook import default_codebook, nearest_level
from kvcompress.quant.outlier_select import weighted_range_outliers
from kvcompress.quant.pack import pack, packed_width, unpack
from kvcompress.quant.pack_widths import (
    MAX_WIDTH,
    bit_map,
    pack_widths,
    stream_bits,
    unpack_widths,
    widths_packed_width,
)
from kvcompress.quant.page_range import ZERO_TOKEN, as_float8, as_stored, page_range, token_scale
from kvcompress.quant.rotation import rotate, unrotate


@dataclass
class NuqCodec(Codec):
    nbits: int = 4
    axis: str = "token"
    outlier_fraction: float = 0.0
    outlier_scope: str = "page"  # "page": the largest of each page; "token": the same count in every token
    codebook: torch.Tensor | None = None  # [L] or [H, L] float32, sorted
    rotation_signs: torch.Tensor | None = None  # [D]
    channel_mean: torch.Tensor | None = None  # [H, D] calibrated
    channel_scale: torch.Tensor | None = None  # [H, D] calibrated
    outlier_weight: torch.Tensor | None = None  # [H, D] calibrated query energy per key channel (outlier_select)
    channel_widths: torch.Tensor | None = None  # [H, D] uint8 calibrated bits per key channel (axis "page")
    outlier_dtype: torch.dtype = torch.float16
    default_codebook: str = "gaussian"  # one of config.CODEBOOKS: levels used when none are given
    scale_format: str = "fp16"  # how scales (and page zeros) are stored: "fp16", "e4m3", "e5m2" (page_range)
    _range_checked: bool = field(default=False, init=False, repr=False, compare=False)  # see page_range
    _stream_bits: int = field(default=0, init=False, repr=False, compare=False)  # code bits per token (widths)

    def __post_init__(self):
        if self.channel_widths is not None:
            self._check_widths()
        if self.codebook is None:
            if self.axis == "page":
                self.codebook = torch.linspace(-1.0, 1.0, 2**self.nbits)
            else:
                self.codebook = default_codebook(self.default_codebook, self.nbits).clone()
        assert self.codebook.shape[-1] == 2**self.nbits, "codebook must have 2**bits levels"
        if self.outlier_weight is not None:
            if self.axis != "page" or self.outlier_scope != "page" or not self.n_outliers:
                raise ConfigError(
                    "outlier_weight picks the outliers of key pages coded on their own range: it needs nuq "
                    "axis='page' with outlier_fraction > 0 (drop the tensor for this stream)"
                )
            if tuple(self.outlier_weight.shape) != (self.num_heads, self.head_dim):
                raise ConfigError(
                    f"outlier_weight has shape {tuple(self.outlier_weight.shape)}, expected [kv heads, head dim] = "
                    f"[{self.num_heads}, {self.head_dim}]: the config was calibrated for another model"
                )

    def _check_widths(self) -> None:
        w = self.channel_widths
        if self.axis != "page" or self.rotation_signs is not None or self.codebook is not None:
            raise ConfigError(
                "channel_widths code each key channel on its page range with its own uniform levels: they need "
                "nuq axis='page' without rotation or a codebook tensor (drop the tensor for this stream)"
            )
        if tuple(w.shape) != (self.num_heads, self.head_dim):
            raise ConfigError(
                f"channel_widths has shape {tuple(w.shape)}, expected [kv heads, head dim] = "
                f"[{self.num_heads}, {self.head_dim}]: the config was calibrated for another model"
            )
        if w.dtype.is_floating_point or bool((w < 0).any()) or bool((w > MAX_WIDTH).any()):
            raise ConfigError(f"channel_widths must be integers in 0..{MAX_WIDTH}; got {w.dtype} in "
                              f"[{float(w.min())}, {float(w.max())}]")
        try:
            self._stream_bits = stream_bits(w)
        except ValueError as e:
            raise ConfigError(f"channel_widths: {e}; recalibrate (calib/widths.py keeps the totals equal)") from e

    @property
    def n_outliers(self) -> int:
        """Outliers per page (per kv head)."""
        if self.outlier_fraction <= 0:
            return 0
        if self.outlier_scope == "token":
            return self.page_size * self.outliers_per_token
        return math.ceil(self.outlier_fraction * self.page_size * self.head_dim)

    @property
    def outliers_per_token(self) -> int:
        """With outlier_scope "token": how many of each token's elements are kept exactly (else 0)."""
        if self.outlier_fraction <= 0 or self.outlier_scope != "token":
            return 0
        return math.ceil(self.outlier_fraction * self.head_dim)

    @property
    def _idx_dtype(self):
        # positions run 0 .. page_size * head_dim - 1: int16 holds them up to 32768 positions (64 x 512)
        return torch.int16 if self.page_size * self.head_dim <= 32768 else torch.int32

    @property
    def _calibrated_channels(self) -> bool:
        return self.channel_mean is not None and self.channel_scale is not None

    def fields(self):
        f = {"codes": (FieldKind.TOKEN, Role.PAYLOAD)}
        if self.axis == "token":
            f["scale"] = (FieldKind.TOKEN, Role.METADATA)
        elif self.axis == "page":
            f["scale"] = (FieldKind.PAGE, Role.METADATA)
            f["zero"] = (FieldKind.PAGE, Role.METADATA)
        elif not self._calibrated_channels:
            f["channel_mean"] = (FieldKind.ROW, Role.METADATA)
            f["channel_scale"] = (FieldKind.ROW, Role.METADATA)
        if self.n_outliers:
            f["outlier_idx"] = (FieldKind.PAGE, Role.METADATA)
            f["outlier_val"] = (FieldKind.PAGE, Role.METADATA)
        return f

    def shared_tensors(self):
        t = {"codebook": self.codebook}
        if self.rotation_signs is not None:
            t["rotation_signs"] = self.rotation_signs
        if self._calibrated_channels:
            t["channel_mean"], t["channel_scale"] = self.channel_mean, self.channel_scale
        if self.outlier_weight is not None:
            t["outlier_weight"] = self.outlier_weight
        if self.channel_widths is not None:
            t["channel_widths"] = self.channel_widths
        return t

    # -- statistics ---------------------------------------------------------------------------
    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.rotation_signs.to(x.device)) if self.rotation_signs is not None else x.float()

    def prepare(self, x):
        if self.axis != "channel" or self._calibrated_channels:
            return {}
        xf = self._rotated(x)  # [B, H, N, D]
        mean = xf.mean(2, keepdim=True)
        scale = xf.std(2, keepdim=True, correction=0).clamp_min(1e-4)
        return {"channel_mean": mean, "channel_scale": scale}

    def _channel_stats(self, row, device):
        if self._calibrated_channels:
            return (
                self.channel_mean.to(device, torch.float32)[None, :, None, :],
                self.channel_scale.to(device, torch.float32)[None, :, None, :],
            )
        return row["channel_mean"], row["channel_scale"]

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, x, row):
        b, h, n, d = x.shape
        xf = self._rotated(x)
        k = self.n_outliers
        out = {}
        if self.axis == "channel":
            mean, scale = self._channel_stats(row, x.device)
            u = (xf - mean) / scale
            if k:
                mask = self._outlier_mask(u, out, xf)
        elif self.axis == "page":
            if k and self.outlier_weight is not None:  # the queries' channel weights pick them
                mp = weighted_range_outliers(self._pages(xf), self.outlier_weight, k)
                chosen = mp.reshape(b, h, n // self.page_size, -1).to(torch.int8)  # k ones per page
                idx = chosen.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(-1).values
                self._store_outliers(idx, out, xf)
            elif k:  # outliers by their z-score within the page's channel
                xp = self._pages(xf)
                mu, sd = xp.mean(3, keepdim=True), xp.std(3, keepdim=True, correction=0).clamp_min(1e-6)
                mask = self._outlier_mask(((xp - mu) / sd).reshape(b, h, n, d), out, xf)
                mp = self._pages(mask)
            else:
                mp = torch.zeros_like(self._pages(xf), dtype=torch.bool)
            xp = self._pages(xf)
            big = torch.finfo(torch.float32).max
            lo = torch.where(mp, big, xp).amin(3)  # [B, H, n_pages, D]
            hi = torch.where(mp, -big, xp).amax(3)
            # stored as x = u * scale + zero (the form the fused kernels read)
            scale, zero = page_range(lo, hi, self.scale_format, check=not self._range_checked)
            self._range_checked = True
            out["scale"], out["zero"] = as_stored(scale), as_stored(zero)
            u = _to_unit(xp, scale, zero).reshape(b, h, n, d)
        else:
            rms = xf.pow(2).mean(-1, keepdim=True).sqrt()
            if k:
                mask = self._outlier_mask(xf / rms.clamp_min(1e-6), out, xf)
                keep = (~mask).float()
                rms = ((xf.pow(2) * keep).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp_min(1)).sqrt()
            scale = token_scale(rms.clamp_min(ZERO_TOKEN), self.scale_format, check=not self._range_checked)
            self._range_checked = True
            out["scale"] = as_stored(scale)
            u = xf / scale.float()
        if self.channel_widths is not None:
            out["codes"] = pack_widths(self._width_codes(u), self.channel_widths, self._bit_map(u.device))
        else:
            out["codes"] = pack(self._nearest(u), self.nbits)
        return out

    def _bit_map(self, device):
        """pack_widths.bit_map of the widths on `device`, from the stream's length counted once (encode and
        decode of captured steps must not sync with the host; nothing is kept, so memory_report holds)."""
        return bit_map(self.channel_widths.to(device), self._stream_bits)

    def _width_levels(self, device) -> torch.Tensor:
        """[1, H, 1, D] levels - 1 per channel (0 for channels of width 0)."""
        w = self.channel_widths.to(device).long()
        return ((1 << w) - 1).float()[None, :, None, :]

    def _width_codes(self, u: torch.Tensor) -> torch.Tensor:
        """u [B, H, N, D] in [-1, 1] -> the nearest of each channel's 2**width uniform levels (ends on the range)."""
        top = self._width_levels(u.device)
        return torch.round((u + 1.0) * 0.5 * top).clamp_min(0).long()

    def _width_units(self, q: torch.Tensor) -> torch.Tensor:
        top = self._width_levels(q.device)
        return torch.where(top > 0, q.float() / top.clamp_min(1.0) * 2.0 - 1.0, torch.zeros((), device=q.device))

    def _outlier_mask(self, u, out, xf):
        """Pick the top |u| elements of each page (or of each token, with outlier_scope "token"); record
        positions (t_in_page * D + c, ascending) and exact values in `out`."""
        b, h, n, d = u.shape
        pages = n // self.page_size
        flat = u.abs().reshape(b, h, pages, self.page_size * d)
        if self.outlier_scope == "token":
            k = self.outliers_per_token
            c = u.abs().topk(k, dim=-1).indices.sort(-1).values  # [B, H, N, k]
            t_in_page = (torch.arange(n, device=u.device) % self.page_size)[:, None]
            idx = (t_in_page * d + c).reshape(b, h, pages, self.page_size * k)
        else:
            idx = flat.topk(self.n_outliers, dim=-1).indices.sort(-1).values  # [B, H, n_pages, k]
        self._store_outliers(idx, out, xf)
        mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
        return mask.reshape(b, h, n, d)

    def _store_outliers(self, idx: torch.Tensor, out, xf) -> None:
        """Record outlier positions idx [B, H, pages, k] (t_in_page * D + c, ascending) and their exact values
        in `out`."""
        out["outlier_idx"] = idx.to(self._idx_dtype)
        out["outlier_val"] = xf.reshape(idx.shape[:3] + (-1,)).gather(-1, idx).to(self.outlier_dtype)

    def _nearest(self, u):
        cb = self.codebook.to(u.device)
        if cb.dim() == 1:
            return nearest_level(u, cb)
        return torch.stack([nearest_level(u[:, i], cb[i]) for i in range(u.shape[1])], 1)

    def decode(self, f, row, dtype):
        if self.channel_widths is not None:
            q = unpack_widths(f["codes"], self.channel_widths, self._bit_map(f["codes"].device))  # [B, H, N, D]
        else:
            q = unpack(f["codes"], self.nbits, self.head_dim).long()
        b, h, n, d = q.shape
        cb = self.codebook.to(q.device)
        if self.channel_widths is not None:
            u = self._width_units(q)
        elif cb.dim() == 1:
            u = cb[q]
        else:
            u = torch.gather(cb[None, :, None, :].expand(b, h, n, -1), -1, q)
        if self.axis == "channel":
            mean, scale = self._channel_stats(row, q.device)
            x = u * scale + mean
        elif self.axis == "page":
            scale, zero = self.scales(f)
            scale, zero = scale.float().unsqueeze(3), zero.float().unsqueeze(3)
            up = u.reshape(b, h, n // self.page_size, self.page_size, d)
            x = (up * scale + zero).reshape(b, h, n, d)
        else:
            x = u * self.scales(f)[0].float()
        if "outlier_idx" in f:
            pages = n // self.page_size
            x = x.reshape(b, h, pages, -1).scatter(-1, f["outlier_idx"].long(), f["outlier_val"].float())
            x = x.reshape(b, h, n, d)
        if self.rotation_signs is not None:
            x = unrotate(x, self.rotation_signs.to(x.device))
        return x.to(dtype)

    def scales(self, f: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero or None) of stored fields in their real dtype (FP8 ones are held as uint8)."""
        zero = f.get("zero")
        fmt = self.scale_format
        return as_float8(f["scale"], fmt), None if zero is None else as_float8(zero, fmt)

    @property
    def bits(self):
        if self.channel_widths is not None:
            b = widths_packed_width(self.channel_widths) * 8 / self.head_dim
        else:
            b = packed_width(self.head_dim, self.nbits) * 8 / self.head_dim
        scale_bits = 16.0 if self.scale_format == "fp16" else 8.0
        if self.axis == "token":
            b += scale_bits / self.head_dim
        elif self.axis == "page":
            b += 2 * scale_bits / self.page_size
        idx_bits = 16 if self._idx_dtype == torch.int16 else 32
        b += self.n_outliers * (idx_bits + torch.finfo(self.outlier_dtype).bits) / (self.page_size * self.head_dim)
        return b


def _to_unit(xp: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[B, H, n, P, D] -> (x - zero) / scale in [-1, 1], with scale / zero [B, H, n, D] (as stored)."""
    scale, zero = scale.float().unsqueeze(3), zero.float().unsqueeze(3)
    return ((xp - zero) / scale).clamp(-1.0, 1.0)
