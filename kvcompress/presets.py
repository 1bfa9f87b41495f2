"""Named presets: `KVCompressConfig.from_preset(name, model_config)` and `CompressedCache(cfg, name)`.

Sliding-window layers always stay exact (they are bounded already). Quantization presets:
- fp8 / fp8-e5m2: 1 byte per element, dynamic per-token scales; 4 sinks and the newest 64 tokens exact.
- int8 / int4 / int3 / int2: KIVI (keys per channel in groups of 32 tokens, values per token in groups
  of 32 channels (of the largest power of two dividing the head dim where 32 does not), the
  newest 128 tokens in full precision); int2 also keeps 8 sinks exact and fits each
  key group's range by least squares instead of spanning its min and max.
- nuq4 / nuq3 / nuq2: keys coded on each page's per-channel range (pages of 48 tokens for nuq4, 32 for
  nuq3, 16 for nuq2; post-RoPE keys drift, so a range per page follows them) with 1% outliers per page
  kept exactly; values normalised per token with a Lloyd-Max codebook (until calibrated): nuq4 a Student-t
  (5 dof) one and no value outliers, 4 exact sinks and the newest 16 tokens exact; nuq3 / nuq2 values
  Hadamard-rotated onto a Gaussian one (TurboQuant), no value outliers, 2% key outliers for nuq3, 8 sinks
  and the newest 64 (nuq3) or 32 (nuq2) exact. Every nuq scale is one byte (FP8 e4m3 key page ranges, e5m2
  value scales).
- nuq4-fast: nuq4 without key outliers, on key pages of 32, for the fused kernel's speed: no exact
  corrections to gather, so it decodes faster (1.15x bf16 SDPA at 32K x 8 on an H200, against nuq4's
  0.83x on pages of 32; 1.66x against nuq4's 1.25x on an H100) at 4.49 bits per element (nuq4 4.57)
  and, on SmolLM2, the same quality within one window's spread (BENCHMARKS.md, "The `nuq4-fast`
  preset"). Models with sharper per-token key spikes may need nuq4's outliers: compare the two with
  `kvcompress eval -p nuq4 -p nuq4-fast` on your model.
- nuq4-vrot: nuq4 with its values Hadamard-rotated onto the Gaussian codebook, as nuq3 / nuq2 hold them:
  the same bits, attention outputs 0.7-7.4 dB cleaner per layer on SmolLM2 and better long-context
  retrieval (BENCHMARKS.md); calibration has no levels to fit on such values.
- nuq4-rot: randomized Hadamard rotation then a per-token Gaussian codebook (TurboQuant), no outliers.
- k8v4: FP8 keys with nuq4 values.
On an MLA layout (key slot = latent kv_nope, value slot = shared RoPE key k_rot) nuq4/nuq3/nuq2 quantize
the latent per channel (trained kv_a_layernorm gains differ per channel: 4-10 dB better SQNR than per
token when they do, equal when they do not), keep the largest 1 % of each token's latent exactly (6 of
512: per token, so the fused MLA kernel folds them into its tile) and keep k_rot in FP8; nuq4-fast is the
same without the latent's outliers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from kvcompress.config import ConfigError, KVCompressConfig, LayerPolicy, QuantSpec
from kvcompress.layout.arch import ModelLayout

LayerFn = Callable[[ModelLayout, int], LayerPolicy]


def _uniform(policy: LayerPolicy) -> LayerFn:
    return lambda layout, i: replace(policy, tensors={})


def _fp8(fmt: str) -> LayerFn:
    # 4 exact sinks and the newest 64 tokens exact. On SmolLM2, mean Δppl over windows (BENCHMARKS.md):
    # +0.080 % at 2048 (4 windows of eval.txt), +0.007 % at 4096 (2 windows), -0.005 % at 2048 on calib.txt
    # (4 windows); a 32-token window gave +0.117 %, +0.016 % and +0.051 %, every token in FP8 +0.25 % at 1024.
    spec = QuantSpec(method="fp8", fp8_format=fmt)
    return _uniform(LayerPolicy(key=spec, value=spec, page_size=16, sinks=4, residual=64))


def _kivi(bits: int, key_fit: str = "minmax", sinks: int = 0) -> LayerFn:
    def layer(layout: ModelLayout, i: int) -> LayerPolicy:
        return LayerPolicy(
            key=QuantSpec(method="int", bits=bits, axis="channel", range_fit=key_fit),
            value=QuantSpec(method="int", bits=bits, axis="token", group_size=value_group(layout.value_head_dim)),
            page_size=32,
            residual=128,
            sinks=sinks,
        )

    return layer


def value_group(head_dim: int, target: int = 32) -> int:
    """KIVI's value groups: 32 channels, or the largest power of two below that dividing the head dim (a head
    of 80 channels takes groups of 16, one of 16 a single group; powers of two, as the fused kernels' tiles)."""
    g = target
    while g > 1 and head_dim % g:
        g //= 2
    return g


NUQ4_PAGE = 48  # tokens per key page of nuq4 / nuq4-vrot (a multiple of 16: the fused kernels read tiles of 16)


def _nuq(bits: int, outliers: float = 0.01, rotated_values: bool = False, page: int = NUQ4_PAGE) -> LayerFn:
    # Measured on SmolLM2 (1024 tokens, prefill 512, decode 512), 4 bits: keys per page of 32 with the
    # newest 32 tokens exact -0.44% ppl; keys frozen per channel, pages of 64, no window +1.22%; keys
    # per page of 64 with a 64-token window +0.65%. Finer key pages matter most.
    # Values (BENCHMARKS.md, 2048 tokens unless said): at 4 bits a Gaussian codebook needs 1% outliers
    # (+0.47%; +19% without), a Student-t (5 dof) one needs none (-0.32% with a 16-token window, -0.61% at
    # 1024, 0.43 bits fewer than a 32-token one) and spares the fused kernel its costliest part. At 3 and 2
    # bits heavier tails than Gaussian's still need their 1% outliers: Laplace levels with 8 sinks give
    # nuq3 +0.74% (Gaussian, 4 sinks: +2.67%) and, on pages of 16, nuq2 +8.7% (Gaussian: +12.2%); rotated
    # values did better still (below).
    # One-byte scales at 4 bits (2026-12-01, bf16 model, 2048 tokens): FP8 e4m3 page ranges for keys and
    # e5m2 token scales for values take 4.96 -> 4.65 bits per element all-in, -0.23% -> -0.71% ppl.
    # Key pages of 48 tokens (2026-12-07, BENCHMARKS.md "nuq4 on key pages of 48"): a third less key range
    # metadata (4.48 -> 4.39 bits stored), and at 2047 cached tokens the same 31 exact ones as pages of 32
    # (4 sinks + 27), so 4.57 bits all-in at 2048 where pages of 32 held 4.65; SmolLM2's KL divergence no
    # higher (float32: 1.91e-3 / 1.94e-3 at 1024, 1.99e-3 / 2.22e-3 at 2048; bf16 ppl at 2048 -0.65 % /
    # -0.06 %). nuq4-fast keeps pages of 32, the layout its speed was measured on.
    key, value = nuq_specs(bits, outliers)
    if bits == 4:
        if rotated_values:  # as nuq3 / nuq2 hold them: Hadamard-rotated onto the Gaussian levels
            value = replace(value, rotation=True, codebook="gaussian")
        return _uniform(LayerPolicy(key=key, value=value, page_size=page, residual=16, sinks=4))
    # nuq3 keeps the newest 64 tokens exact (bf16 model, BENCHMARKS.md "nuq3 with a 64-token exact window"):
    # +0.136% at 4096 (32 tokens: +0.441%, quanto int4 +0.267%), +0.890% at 2048 (+1.454%; quanto +1.166%),
    # +0.215% over 4 windows of 1024 (+0.361%), for 0.10 more bits per element at 4096.
    if bits == 3:
        return _uniform(LayerPolicy(key=key, value=value, page_size=32, residual=64, sinks=8))
    return _uniform(LayerPolicy(key=key, value=value, page_size=16, residual=32, sinks=8))


def nuq_specs(bits: int, outliers: float = 0.01) -> tuple[QuantSpec, QuantSpec]:
    """The (key, value) QuantSpecs of the nuq{bits} preset; calibration's mixed choices use them too."""
    if bits == 4:
        key = QuantSpec(method="nuq", bits=bits, axis="page", outlier_fraction=outliers, scale_format="e4m3")
        value = QuantSpec(method="nuq", bits=bits, axis="token", codebook="student_t5", scale_format="e5m2")
        return key, value
    # At 3 and 2 bits (2026-12-01, bf16 model, means over 4 windows of 1024 tokens, BENCHMARKS.md) values
    # Hadamard-rotated onto a Gaussian codebook (TurboQuant) lose less than Laplace levels with 1% outliers:
    # nuq3 +0.63% against +1.04%, and with 2% key outliers +0.36%; nuq2 +5.0% against +8.1%.
    key_outliers = 2 * outliers if bits == 3 else outliers
    key = QuantSpec(method="nuq", bits=bits, axis="page", outlier_fraction=key_outliers, scale_format="e4m3")
    value = QuantSpec(method="nuq", bits=bits, axis="token", rotation=True, scale_format="e5m2")
    return key, value


def _nuq_rot(bits: int) -> LayerFn:
    spec = QuantSpec(method="nuq", bits=bits, axis="token", rotation=True)
    return _uniform(LayerPolicy(key=spec, value=spec, page_size=64, sinks=4))


def _k8v4() -> LayerFn:
    return _uniform(
        LayerPolicy(
            key=QuantSpec(method="fp8"),
            value=QuantSpec(method="nuq", bits=4, axis="token", outlier_fraction=0.01),
            page_size=64,
            sinks=4,
        )
    )


def _bnb(kind: str) -> LayerFn:
    spec = QuantSpec(method="bnb", bnb_type=kind, bnb_blocksize=64)
    return _uniform(LayerPolicy(key=spec, value=spec, page_size=64))


def _nuq_mla(bits: int, outliers: float = 0.01) -> LayerFn:
    return _uniform(
        LayerPolicy(
            key=QuantSpec(method="nuq", bits=bits, axis="channel", outlier_fraction=outliers, outlier_scope="token"),
            value=QuantSpec(method="fp8"),
            page_size=64,
            sinks=4,
        )
    )


# What a preset means on an MLA layout, where it differs from the GQA meaning.
MLA_PRESETS: dict[str, LayerFn] = {
    "nuq4": _nuq_mla(4), "nuq3": _nuq_mla(3), "nuq2": _nuq_mla(2), "nuq4-fast": _nuq_mla(4, outliers=0.0),
    "nuq4-vrot": _nuq_mla(4),  # the value slot is the RoPE key there: nuq4's latent, as nuq4
}


PRESETS: dict[str, LayerFn] = {
    "none": _uniform(LayerPolicy()),
    "fp8": _fp8("e4m3"),
    "fp8-e5m2": _fp8("e5m2"),
    "int8": _kivi(8),
    "int4": _kivi(4),
    "int3": _kivi(3),
    # int2: 8 exact sinks and key ranges fitted by least squares. On SmolLM2 (float32, one window,
    # BENCHMARKS.md "int2 with fitted key ranges") +5.1 % at 2048 and +5.2 % at 4096; plain KIVI +33 % /
    # +28 %, with the sinks alone +10.9 % at 2048, fitted ranges without sinks +76 % (the clip cuts the
    # sinks' keys).
    "int2": _kivi(2, key_fit="mse", sinks=8),
    "nuq4": _nuq(4),
    "nuq3": _nuq(3),
    "nuq2": _nuq(2),
    "nuq4-fast": _nuq(4, outliers=0.0, page=32),
    # nuq4 with its values Hadamard-rotated onto the Gaussian levels, same bits. On SmolLM2 in bf16
    # (BENCHMARKS.md, "What a value codec costs attention"): every layer's attention output 0.7-7.4 dB
    # cleaner, the KL divergence from the uncompressed cache 28 % lower over 4 windows of 1024, the passkey
    # answer's log-probability at 4096 tokens 0.18 nats under the uncompressed cache's instead of 0.51 (20
    # paired trials). Not yet nuq4 itself: calibration fits nothing on rotated values, and the fused kernels'
    # cost of the rotation wants re-timing.
    "nuq4-vrot": _nuq(4, rotated_values=True),
    "nuq4-rot": _nuq_rot(4),
    "k8v4": _k8v4(),
    "bnb-nf4": _bnb("nf4"),
    "bnb-fp4": _bnb("fp4"),
}


def register_preset(name: str, fn: LayerFn) -> None:
    PRESETS[name] = fn


def preset_names() -> list[str]:
    _load_extra_presets()
    return sorted(PRESETS)


def _load_extra_presets() -> None:
    import kvcompress.sparse.presets  # noqa: F401  (sparsity presets register themselves)


def build_preset(name: str, layout: ModelLayout) -> KVCompressConfig:
    _load_extra_presets()
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    fn = MLA_PRESETS.get(name, PRESETS[name]) if layout.attention == "mla" else PRESETS[name]
    layers = [LayerPolicy() if layout.is_sliding(i) else fn(layout, i) for i in range(layout.num_layers)]
    return KVCompressConfig(layout=layout, layers=layers, name=name)
