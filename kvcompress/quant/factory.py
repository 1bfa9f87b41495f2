"""Builds the Codec a QuantSpec asks for, with the layer's calibrated tensors."""

from __future__ import annotations

import torch

from kvcompress.config import ConfigError, QuantSpec
from kvcompress.quant.base import Codec
from kvcompress.quant.rotation import random_signs


def make_codec(
    spec: QuantSpec,
    *,
    page_size: int,
    head_dim: int,
    num_heads: int,
    dtype: torch.dtype,
    tensors: dict[str, torch.Tensor],
    seed: int,
) -> Codec:
    """The codec for one stream; `tensors` are the stream's calibrated tensors ("codebook", "scale", ...)."""
    common = dict(page_size=page_size, head_dim=head_dim, num_heads=num_heads)
    if spec.method == "none":
        from kvcompress.quant.identity import IdentityCodec

        return IdentityCodec(dtype=dtype, **common)
    if spec.method == "fp8":
        from kvcompress.quant.fp8 import Fp8Codec

        shift = tensors.get("shift")
        if shift is not None and tuple(shift.shape) != (num_heads, head_dim):
            raise ConfigError(
                f"an FP8 stream's shift must be [kv heads, head dim] = [{num_heads}, {head_dim}], got "
                f"{list(shift.shape)}: the config was made for another model; calibrate this one"
            )
        return Fp8Codec(fmt=spec.fp8_format, static_scale=tensors.get("scale"), channel_shift=shift, **common)
    if spec.method == "int":
        from kvcompress.quant.uniform import UniformCodec

        axis = "channel" if spec.axis == "page" else spec.axis  # int: both mean per channel within each page
        return UniformCodec(
            nbits=spec.bits, axis=axis, group_size=spec.group_size, range_fit=spec.range_fit, **common
        )
    if spec.method == "nuq":
        from kvcompress.quant.nuq import NuqCodec

        signs = tensors.get("rotation_signs")
        if spec.rotation and signs is None:
            signs = random_signs(head_dim, seed)
        return NuqCodec(
            nbits=spec.bits,
            axis=spec.axis,
            outlier_fraction=spec.outlier_fraction,
            outlier_scope=spec.outlier_scope,
            scale_format=spec.scale_format,
            codebook=tensors.get("codebook"),
            default_codebook=spec.codebook,
            rotation_signs=signs if spec.rotation else None,
            channel_mean=tensors.get("channel_mean"),
            channel_scale=tensors.get("channel_scale"),
            outlier_weight=tensors.get("outlier_weight"),
            channel_widths=tensors.get("channel_widths"),
            outlier_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float16,
            **common,
        )
    if spec.method == "bnb":
        from kvcompress.quant.bnb import BnbCodec

        return BnbCodec(quant_type=spec.bnb_type, blocksize=spec.bnb_blocksize, **common)
    raise ValueError(f"no codec for method {spec.method!r}")
