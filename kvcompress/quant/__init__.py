"""Quantizers: one file per method on the Codec base (quant/base.py)."""

from kvcompress.quant.base import Codec, FieldKind, Role
from kvcompress.quant.factory import make_codec

__all__ = ["Codec", "FieldKind", "Role", "make_codec"]
