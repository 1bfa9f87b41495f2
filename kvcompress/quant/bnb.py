"""NF4 / FP4 blockwise 4-bit codes through bitsandbytes (QLoRA, Dettmers et al. 2023, arXiv:2305.14314).

A library-backed baseline beside nuq: each block of `blocksize` consecutive channels of one token is
divided by its absmax and coded as the nearest of 16 fixed levels (NF4: quantiles of a normal
distribution; FP4: a 4-bit float). No outliers, no calibration. The blocksize must divide the head
dim so a block never straddles two tokens; then both fields are per token and the cache, eviction and
the memory report treat them like any other codec's:

- codes  (TOKEN, payload):  uint8 [B, H, N, D/2], bitsandbytes' nibble order (even channel in the high nibble)
- absmax (TOKEN, metadata): float32 [B, H, N, D/blocksize]

So a stored element costs 4 + 32 / blocksize bits (4.5 at blocksize 64). bitsandbytes is an optional
dependency, imported when a codec is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from kvcompress.quant.base import Codec, FieldKind, Role

INSTALL_HINT = 'pip install "kvcompress[bnb]"'
BNB_TYPES = ("nf4", "fp4")
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes.functional accepts
_BNB_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def bnb_functional():
    """The `bitsandbytes.functional` module, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("bitsandbytes.functional")
    except ImportError as e:
        raise ImportError(
            f"the bnb quantizer (presets 'bnb-nf4', 'bnb-fp4') needs bitsandbytes, which is not installed: "
            f"{INSTALL_HINT}"
        ) from e


@dataclass
class BnbCodec(Codec):
    quant_type: str = "nf4"
    blocksize: int = 64

    def __post_init__(self):
        if self.quant_type not in BNB_TYPES:
            raise ValueError(f"bnb quant_type must be one of {BNB_TYPES}, got {self.quant_type!r}")
        if self.blocksize not in BNB_BLOCKSIZES or self.head_dim % self.blocksize:
            fits = [b for b in BNB_BLOCKSIZES if self.head_dim % b == 0]
            fix = f"use bnb_blocksize in {fits}" if fits else "use the 'nuq' or 'int' method for this model"
            raise ValueError(
                f"bnb blocksize {self.blocksize} must be one of bitsandbytes' {BNB_BLOCKSIZES} and divide the "
                f"head dim {self.head_dim}, so that a block never straddles two tokens; {fix}"
            )
        bnb_functional()  # fail here, at the point of use, with the install hint

    def fields(self):
        return {"codes": (FieldKind.TOKEN, Role.PAYLOAD), "absmax": (FieldKind.TOKEN, Role.METADATA)}

    def encode(self, x, row):
        """x: [B, H, n*P, D] -> codes uint8 [B, H, N, D/2], absmax float32 [B, H, N, D/blocksize]."""
        b, h, n, d = x.shape
        flat = x.reshape(-1)  # token-major, so each block is `blocksize` channels of one token
        if flat.dtype not in _BNB_DTYPES:
            flat = flat.float()
        codes, state = bnb_functional().quantize_4bit(flat, blocksize=self.blocksize, quant_type=self.quant_type)
        return {
            "codes": codes.reshape(b, h, n, d // 2),
            "absmax": state.absmax.float().reshape(b, h, n, d // self.blocksize),
        }

    def decode(self, f, row, dtype):
        F = bnb_functional()
        codes = f["codes"]  # [B, H, N, D/2]
        b, h, n, _ = codes.shape
        out_dtype = dtype if dtype in _BNB_DTYPES else torch.float32
        # A 1-D shape: bitsandbytes 0.50's CPU kernel mis-scales blocks wider than the last dim of the
        # shape it is given (measured 11 dB instead of 20 dB SQNR at blocksize 128, head dim 64); as one
        # row every block lies inside it.
        state = F.QuantState(
            absmax=f["absmax"].reshape(-1).float().contiguous(),
            shape=torch.Size([b * h * n * self.head_dim]),
            dtype=out_dtype,
            blocksize=self.blocksize,
            quant_type=self.quant_type,
        )
        x = F.dequantize_4bit(codes.reshape(-1, 1).contiguous(), state)
        return x.reshape(b, h, n, self.head_dim).to(dtype)

    @property
    def bits(self):
        return 4.0 + 32.0 / self.blocksize
