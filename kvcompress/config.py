"""What the user asks for: a per-layer policy of how K and V are kept, saved as one safetensors file.

Tensors (codebooks, scales, thresholds) live under flat keys such as ``layers.3.key.codebook``;
the structure is JSON in the safetensors metadata under ``"kvcompress"``, checked against an
allow-list and the format version on load. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from kvcompress.layout.arch import ModelLayout

FORMAT_VERSION = 1

QUANT_METHODS = ("none", "fp8", "int", "nuq", "bnb")
FP8_FORMATS = ("e4m3", "e5m2")
# FP8 streams calibration shifts by their channel means (`calibrate --fp8-shift`), and the default
FP8_SHIFTS = ("none", "keys", "both")
FP8_SHIFT_DEFAULT = "keys"
QUANT_AXES = ("channel", "token", "page")
CODEBOOKS = ("gaussian", "laplace", "student_t5")
OUTLIER_SCOPES = ("page", "token")
SCALE_FORMATS = ("fp16", "e4m3", "e5m2")
INT_RANGE_FITS = ("minmax", "mse")  # QuantSpec.range_fit (method "int")
SPARSITY_METHODS = ("none", "streaming", "h2o", "snapkv", "quest")
BUDGET_SHARING = ("none", "heads", "layers")  # SparsitySpec.budget_sharing (Quest)
# Per-stream tensors a config may carry (key.<name> / value.<name>), and per-layer ones.
# fp8_scale: calibrated static FP8 scales [H] of the stream as it is (no shift), kept for serving-engine
# exports. channel_widths: a nuq page stream's bits per channel [H, D] (calib/widths.py). shift: an FP8 stream's per-channel shift [H, D] (x = fp8 * scale + shift). outlier_threshold:
# the calibrated |u| above which `outlier_fraction` of the normalised elements lie [H], recorded for
# inspection only: the codec keeps a fixed count per page (outlier_fraction of it), so that every page's
# outlier list has one size the fused kernels can read, and a page of unusual tokens still keeps its largest.
STREAM_TENSORS = (
    "codebook", "scale", "channel_mean", "channel_scale", "outlier_threshold", "rotation_signs", "fp8_scale",
    "shift", "outlier_weight", "channel_widths",
)
LAYER_TENSORS = ()
_TENSOR_KEY = re.compile(r"^layers\.(\d+)\.(key|value)\.([a-z][a-z0-9_]*)$")


class ConfigError(ValueError):
    """A kvcompress config that cannot be used: the message says what is wrong and how to fix it."""


@dataclass
class QuantSpec:
    """How one stream (keys or values) of one layer is quantized.

    method: "none" (model dtype), "fp8", "int" (KIVI-style asymmetric integers), "nuq" (non-uniform
    codebook, KVQuant/TurboQuant style) or "bnb" (bitsandbytes NF4/FP4).
    axis: "token" = statistics per token (values); "page" = per channel within each page (keys, KIVI's
    grouping); "channel" = per channel for the whole sequence (nuq: calibrated or frozen at the first
    page; for "int" it means per channel within each page, as "page" does there).
    group_size: channels per group for per-token statistics (0 = the whole head).
    codebook: nuq's data-oblivious levels where calibration gives none: Lloyd-Max for a unit-variance
    Gaussian, Laplace or Student-t (5 degrees of freedom) density (the last two for heavy-tailed streams).
    outlier_scope: where nuq's exact outliers are chosen: the largest `outlier_fraction` of each page
    ("page"), or the same number in every token ("token": a fixed count per token, which the MLA kernel
    folds into its tile instead of correcting afterwards).
    scale_format: how a nuq stream stores its scales: "fp16" (2 bytes) or FP8 "e4m3" / "e5m2" (1 byte). On
    axis="page" it holds each page's per-channel range (scale and zero: the zero rounded to nearest, the scale
    then widened so the range stays covered; e4m3 clips keys beyond +-896); on axis="token" the per-token
    scale, rounded to nearest (e5m2 reaches down to 6e-5 in normal numbers, e4m3 to 0.016).
    range_fit (method "int"): "minmax" spans each group's min and max (KIVI); "mse" shrinks each group's range
    about its middle to the ratio (1.0 to 0.6) with the least squared error and clips what falls outside
    (the int2 preset's keys: attention sinks must then stay exact, whose keys the clip would cut).
    """

    method: str = "none"
    bits: int = 16
    fp8_format: str = "e4m3"
    axis: str = "token"
    group_size: int = 0
    outlier_fraction: float = 0.0
    rotation: bool = False
    bnb_type: str = "nf4"
    bnb_blocksize: int = 64
    codebook: str = "gaussian"
    outlier_scope: str = "page"
    scale_format: str = "fp16"
    range_fit: str = "minmax"

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ConfigError(f"unknown quantization method {self.method!r}; use one of {QUANT_METHODS}")
        if self.axis not in QUANT_AXES:
            raise ConfigError(f"unknown quantization axis {self.axis!r}; use one of {QUANT_AXES}")
        if self.method == "fp8":
            if self.fp8_format not in FP8_FORMATS:
                raise ConfigError(f"unknown fp8 format {self.fp8_format!r}; use one of {FP8_FORMATS}")
            self.bits = 8
        if self.method == "int" and self.bits not in (2, 3, 4, 8):
            raise ConfigError(f"int quantization supports 2, 3, 4 or 8 bits, not {self.bits}")
        if self.method == "nuq" and self.bits not in (2, 3, 4):
            raise ConfigError(f"nuq quantization supports 2, 3 or 4 bits, not {self.bits}")
        if self.method == "bnb":
            self.bits = 4
        if not 0.0 <= self.outlier_fraction < 0.5:
            raise ConfigError(f"outlier_fraction must be in [0, 0.5), got {self.outlier_fraction}")
        if self.group_size < 0:
            raise ConfigError(f"group_size must be >= 0, got {self.group_size}")
        if self.group_size and self.method == "nuq":
            raise ConfigError(
                f"group_size does not apply to method='nuq' (it normalises whole tokens or channels, see "
                f"`axis`): remove group_size={self.group_size}"
            )
        if self.outlier_scope not in OUTLIER_SCOPES:
            raise ConfigError(f"unknown outlier_scope {self.outlier_scope!r}; use one of {OUTLIER_SCOPES}")
        if self.scale_format not in SCALE_FORMATS:
            raise ConfigError(f"unknown scale_format {self.scale_format!r}; use one of {SCALE_FORMATS}")
        if self.scale_format != "fp16" and (self.method != "nuq" or self.axis == "channel"):
            raise ConfigError(
                f"scale_format={self.scale_format!r} applies to method='nuq' with axis='page' or 'token', "
                f"not method={self.method!r} axis={self.axis!r}: leave scale_format='fp16'"
            )
        if self.range_fit not in INT_RANGE_FITS:
            raise ConfigError(f"unknown range_fit {self.range_fit!r}; use one of {INT_RANGE_FITS}")
        if self.range_fit != "minmax" and self.method != "int":
            raise ConfigError(
                f"range_fit={self.range_fit!r} applies to method='int', not {self.method!r}: "
                "leave range_fit='minmax'"
            )
        if self.codebook not in CODEBOOKS:
            raise ConfigError(f"unknown codebook {self.codebook!r}; use one of {CODEBOOKS}")
        # options the method's codec never reads are refused rather than silently ignored
        unread = []
        if self.method != "nuq":
            unread += [f"outlier_fraction={self.outlier_fraction}"] * bool(self.outlier_fraction)
            unread += ["rotation=True"] * self.rotation
            unread += [f"codebook={self.codebook!r}"] * (self.codebook != "gaussian")
            unread += [f"outlier_scope={self.outlier_scope!r}"] * (self.outlier_scope != "page")
        if self.method in ("none", "fp8", "bnb") and self.group_size:
            unread.append(f"group_size={self.group_size}")
        if unread:
            what = ", ".join(unread)
            raise ConfigError(
                f"{what} {'does' if len(unread) == 1 else 'do'} not apply to method={self.method!r} (outliers, "
                f"rotation, codebooks and outlier scopes are nuq's; group_size is int's per-token groups): "
                f"remove {what}"
            )

    def check_head_dim(self, head_dim: int, where: str) -> None:
        """Raise a ConfigError when this spec cannot code a stream of `head_dim` channels."""
        if self.rotation and (head_dim <= 0 or head_dim & (head_dim - 1)):
            raise ConfigError(
                f"{where}: the Hadamard rotation needs a power-of-two head dim, and this model's is {head_dim}; "
                "use a config without rotation (nuq4, int4, fp8)"
            )
        group = self.group_size or head_dim
        if self.method == "int" and self.axis == "token" and head_dim % group:
            raise ConfigError(
                f"{where}: int groups of {group} channels must divide the head dim {head_dim}; set group_size to "
                f"a divisor of {head_dim} (0: the whole head)"
            )

    @property
    def is_lossless(self) -> bool:
        return self.method == "none"


@dataclass
class SparsitySpec:
    """Which tokens a layer keeps (H2O, StreamingLLM, SnapKV) or reads (Quest).

    budget: tokens kept (or read, for Quest) per kv head; ratio: the same as a share of the
    context, used when budget is 0. recent: the recent window always kept. page_size: Quest pages.
    budget_sharing (Quest): "none": every kv head reads `budget` tokens; "heads": the layer's kv heads
    share its pages (ranked across heads by their estimated attention mass); "layers": the same, and
    the sparse layers also share one step's pages (each gets a share by the previous step's estimates).
    sinks: first tokens always kept (StreamingLLM, H2O). merge (H2O, full-precision layers): fold each evicted
    token into its most similar kept one instead of dropping it (kvcompress.sparse.merge). unread_means
    (Quest): each page a step does not read still takes part in the attention as one token standing for its
    page: the centre of its key box, the mean of its values, weighted by its token count
    (kvcompress.sparse.unread); it keeps a mean value per page beside the key summaries. head_shares (H2O,
    full-precision layers): one factor per kv head, head h keeping ceil(head_shares[h] x the budget) tokens
    (a mean of 1 keeps the layer's total at the budget), held packed (kvcompress.sparse.ragged); empty: every
    head the budget. `kvcompress calibrate` fits them from the model's attention (kvcompress.calib.head_budgets).
    """

    method: str = "none"
    budget: int = 0
    ratio: float = 0.0
    recent: int = 0
    sinks: int = 0
    page_size: int = 16
    observation_window: int = 32
    pool_kernel: int = 7
    dense_layers: int = 0
    budget_sharing: str = "none"
    merge: bool = False
    unread_means: bool = False
    head_shares: list[float] = field(default_factory=list)

    def __post_init__(self):
        if self.method not in SPARSITY_METHODS:
            raise ConfigError(f"unknown sparsity method {self.method!r}; use one of {SPARSITY_METHODS}")
        if self.budget < 0 or not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"sparsity budget must be >= 0 and ratio in [0, 1]; got {self.budget}, {self.ratio}")
        if self.budget_sharing not in BUDGET_SHARING:
            raise ConfigError(f"unknown budget_sharing {self.budget_sharing!r}; use one of {BUDGET_SHARING}")
        if self.method != "none" and self.budget == 0 and self.ratio == 0.0:
            raise ConfigError(f"sparsity method {self.method!r} needs a token budget or a ratio of the context")
        if self.merge and self.method != "h2o":
            raise ConfigError(f"merge applies to H2O's evictions, not to {self.method!r}; drop merge=True")
        # options the method's policy never reads are refused rather than silently ignored
        if self.recent and self.method != "h2o":
            raise ConfigError(
                f"recent (a window always kept) applies to H2O, not to {self.method!r}: StreamingLLM keeps its "
                f"budget less its sinks as the recent window, Quest always reads the newest page and a "
                f"quantized layer's exact tail (LayerPolicy.residual), SnapKV keeps its observation window; "
                f"drop recent={self.recent}")
        if self.sinks and self.method not in ("h2o", "streaming"):
            raise ConfigError(
                f"sinks apply to H2O and StreamingLLM, not to {self.method!r}: Quest always reads the first "
                f"page; to keep the first tokens exact in a quantized layer use LayerPolicy.sinks; drop "
                f"sinks={self.sinks}")
        if self.unread_means and self.method != "quest":
            raise ConfigError(
                f"unread_means stands in for the pages Quest does not read, not for {self.method!r}'s "
                f"evicted tokens (H2O can merge them: merge=True); drop unread_means=True")
        if self.head_shares:
            self.head_shares = [float(x) for x in self.head_shares]
            if self.method != "h2o":
                raise ConfigError(f"head_shares apply to H2O's per-kv-head budgets, not to {self.method!r}; drop "
                                  f"head_shares")
            if self.merge:
                raise ConfigError("head_shares and merge=True cannot be combined (a merge keeps one count for "
                                  "every head); use one of them")
            if not all(0.0 < x < float("inf") for x in self.head_shares):
                raise ConfigError(f"head_shares must be positive and finite; got {self.head_shares}")
        if self.budget_sharing != "none" and self.method != "quest":
            raise ConfigError(f"budget_sharing applies to Quest's page selection, not to {self.method!r}; drop "
                              f"budget_sharing={self.budget_sharing!r}")

    @property
    def needs_attention(self) -> bool:
        """Whether the layer runs under the kvcompress attention: every policy does. H2O and SnapKV read the
        attention weights, Quest the query; StreamingLLM reads neither but evicts where that attention
        hands the step's padding mask to its policy (kvcompress.sparse.state)."""
        return self.method != "none"


@dataclass
class LayerPolicy:
    """How one layer keeps its cache.

    page_size: tokens quantized together (one page of the paged store); residual: newest tokens kept in
    full precision beyond the partly filled page; sinks: first tokens kept exact.
    tensors: calibrated data, keyed "key.codebook", "value.scale", ...
    """

    key: QuantSpec = field(default_factory=QuantSpec)
    value: QuantSpec = field(default_factory=QuantSpec)
    page_size: int = 64
    residual: int = 0
    sinks: int = 0
    sparsity: SparsitySpec = field(default_factory=SparsitySpec)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if self.page_size < 1 or self.residual < 0 or self.sinks < 0:
            raise ConfigError(
                f"page_size must be >= 1 and residual, sinks >= 0; got {self.page_size}, {self.residual}, {self.sinks}"
            )
        if self.sparsity.merge and not (self.key.is_lossless and self.value.is_lossless):
            raise ConfigError(
                "H2O merge needs full-precision keys and values (a merged token cannot enter a quantized "
                "page without re-quantizing it); use merge=False with quantization, or merge without it"
            )
        if self.sparsity.head_shares and not (self.key.is_lossless and self.value.is_lossless):
            raise ConfigError(
                "H2O head_shares need full-precision keys and values (quantized pages are stored for every kv "
                "head at once, so heads cannot keep different counts); drop head_shares with quantization"
            )
        for name in self.tensors:
            stream, _, tname = name.partition(".")
            if stream not in ("key", "value") or tname not in STREAM_TENSORS:
                raise ConfigError(f"unknown layer tensor {name!r}; allowed: key|value.{STREAM_TENSORS}")

    @property
    def is_lossless(self) -> bool:
        return self.key.is_lossless and self.value.is_lossless and self.sparsity.method == "none"

    def stream_tensors(self, stream: str) -> dict[str, torch.Tensor]:
        prefix = stream + "."
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}


@dataclass
class KVCompressConfig:
    """A whole-model kvcompress config: one LayerPolicy per layer, for the model in `layout`."""

    layout: ModelLayout
    layers: list[LayerPolicy]
    name: str = "custom"
    version: int = FORMAT_VERSION
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.layers) != self.layout.num_layers:
            raise ConfigError(
                f"config has {len(self.layers)} layer policies but the model has {self.layout.num_layers} layers"
            )
        for i, policy in enumerate(self.layers):
            policy.key.check_head_dim(self.layout.key_head_dim, f"layer {i} keys ({self.name})")
            policy.value.check_head_dim(self.layout.value_head_dim, f"layer {i} values ({self.name})")
            shares = policy.sparsity.head_shares
            if shares and len(shares) != self.layout.num_kv_heads:
                raise ConfigError(
                    f"layer {i} ({self.name}): {len(shares)} head_shares for a model with "
                    f"{self.layout.num_kv_heads} kv heads per layer; give one share per kv head"
                )

    # -- presets ----------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, model_config) -> "KVCompressConfig":
        """Build a named preset ("none", "fp8", "nuq4", ...) for a model (HF config or ModelLayout)."""
        from kvcompress.presets import build_preset

        layout = model_config if isinstance(model_config, ModelLayout) else ModelLayout.from_model_config(model_config)
        return build_preset(name, layout)

    @property
    def needs_attention(self) -> bool:
        """Whether some layer's sparsity policy needs `kvcompress.enable(model)`."""
        return any(p.sparsity.needs_attention for p in self.layers)

    def check_model(self, layout: ModelLayout) -> None:
        """Raise a ConfigError naming each fingerprint difference if this config is for another model."""
        diff = layout.mismatch(self.layout)
        if diff:
            raise ConfigError(
                f"this kvcompress config ({self.name!r}) was made for a different model: "
                + "; ".join(diff)
                + ". Calibrate a config for this model (`kvcompress calibrate MODEL`) or use a preset."
            )

    # -- save / load ------------------------------------------------------------------------
    def to_metadata(self) -> dict:
        layers = []
        for lp in self.layers:
            d = {f.name: getattr(lp, f.name) for f in fields(lp) if f.name != "tensors"}
            d["key"], d["value"], d["sparsity"] = asdict(lp.key), asdict(lp.value), asdict(lp.sparsity)
            layers.append(d)
        return {
            "format": "kvcompress",
            "version": self.version,
            "name": self.name,
            "fingerprint": self.layout.fingerprint(),
            "layers": layers,
            "notes": self.notes,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write one .safetensors file atomically (a temporary file renamed into place)."""
        from kvcompress.atomic import write_safetensors

        tensors = {}
        for i, lp in enumerate(self.layers):
            for name, t in lp.tensors.items():
                tensors[f"layers.{i}.{name}"] = t
        write_safetensors(path, tensors, metadata={"kvcompress": json.dumps(self.to_metadata())})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KVCompressConfig":
        """Read a config written by `save`. Raises ConfigError for foreign, truncated or newer files."""
        from safetensors import SafetensorError, safe_open

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"no kvcompress config at {path!r}")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(
                f"{path!r} is not a readable safetensors file ({e}); it may be truncated or not a kvcompress "
                "config. Re-create it with `kvcompress calibrate` or KVCompressConfig.save()."
            ) from e
        if "kvcompress" not in meta:
            raise ConfigError(
                f"{path!r} is a safetensors file but not a kvcompress config (no 'kvcompress' metadata); "
                "pass a file written by `kvcompress calibrate` or KVCompressConfig.save()."
            )
        try:
            doc = json.loads(meta["kvcompress"])
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path!r}: the kvcompress metadata is not valid JSON ({e})") from e
        return cls.from_metadata(doc, tensors, source=path)

    @classmethod
    def from_metadata(cls, doc: dict, tensors: dict[str, torch.Tensor], source: str = "<memory>"):
        if not isinstance(doc, dict) or doc.get("format") != "kvcompress":
            raise ConfigError(f"{source}: metadata is not a kvcompress config")
        version = doc.get("version")
        if version != FORMAT_VERSION:
            raise ConfigError(
                f"{source}: config format version {version!r} is not supported by this kvcompress "
                f"(it reads version {FORMAT_VERSION}); upgrade kvcompress or re-create the config."
            )
        _check_keys(doc, {"format", "version", "name", "fingerprint", "layers", "notes"}, source)
        _require_keys(doc, ("name", "fingerprint", "layers"), source)
        if not isinstance(doc["layers"], list):
            raise ConfigError(f"{source}: 'layers' must be a list of layer policies")
        try:
            layout = ModelLayout.from_fingerprint(doc["fingerprint"])
        except (TypeError, KeyError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ConfigError(f"{source}: bad model fingerprint ({what}); re-create the config") from e
        per_layer: list[dict[str, torch.Tensor]] = [dict() for _ in doc["layers"]]
        for key, t in tensors.items():
            m = _TENSOR_KEY.match(key)
            if not m or m.group(3) not in STREAM_TENSORS or int(m.group(1)) >= len(per_layer):
                raise ConfigError(f"{source}: unexpected tensor {key!r} in a kvcompress config")
            per_layer[int(m.group(1))][f"{m.group(2)}.{m.group(3)}"] = t
        layers = []
        allowed = {f.name for f in fields(LayerPolicy)} - {"tensors"}
        for i, d in enumerate(doc["layers"]):
            _check_keys(d, allowed, f"{source}: layer {i}")
            _require_keys(d, ("key", "value", "sparsity"), f"{source}: layer {i}")
            _check_keys(d["key"], {f.name for f in fields(QuantSpec)}, f"{source}: layer {i} key")
            _check_keys(d["value"], {f.name for f in fields(QuantSpec)}, f"{source}: layer {i} value")
            _check_keys(d["sparsity"], {f.name for f in fields(SparsitySpec)}, f"{source}: layer {i} sparsity")
            try:
                policy = LayerPolicy(
                    key=QuantSpec(**d["key"]),
                    value=QuantSpec(**d["value"]),
                    sparsity=SparsitySpec(**d["sparsity"]),
                    tensors=per_layer[i],
                    **{k: v for k, v in d.items() if k not in ("key", "value", "sparsity")},
                )
            except TypeError as e:  # a value of the wrong JSON type, e.g. "page_size": "64"
                raise ConfigError(f"{source}: layer {i} has a field of the wrong type ({e})") from e
            layers.append(policy)
        return cls(layout=layout, layers=layers, name=doc["name"], version=version, notes=doc.get("notes", {}))

    # -- helpers ----------------------------------------------------------------------------
    def with_layer(self, idx: int, **changes) -> "KVCompressConfig":
        layers = list(self.layers)
        layers[idx] = replace(layers[idx], **changes)
        return replace(self, layers=layers)

    def __eq__(self, other) -> bool:
        if not isinstance(other, KVCompressConfig):
            return NotImplemented
        if self.to_metadata() != other.to_metadata():
            return False
        for a, b in zip(self.layers, other.layers):
            if a.tensors.keys() != b.tensors.keys():
                return False
            if any(not torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors):
                return False
        return True


def _require_keys(d: dict, required, where: str) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}; re-create it with KVCompressConfig.save()")


def _check_keys(d: dict, allowed: set, where: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
