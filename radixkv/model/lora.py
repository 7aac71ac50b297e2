"""LoRA adapters in PEFT format: reading, validation, weight digest, and the batched delta.

An adapter is a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``
(what PEFT's ``save_pretrained`` writes). For every targeted projection ``W [out, in]`` it adds
``scale · B A`` with ``A [r, in]`` and ``B [out, r]``; ``scale = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``. Targets are the attention and MLP projections
(``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``) in Hugging Face layout, which is
the layout :class:`radixkv.model.llama.LlamaForward` keeps (the GGUF loader un-permutes q/k), so
an adapter trained against the HF model applies unchanged.

The forward never merges: the base projection runs once over all packed tokens and each adapter
adds ``((x A^T) B^T)`` to the rows of its own sequences (:class:`LoRABatch`), so requests with
different adapters, and none, share one forward. The forward fuses q/k/v and gate/up; an adapter
is stored the same way per layer, ``A_cat [R, in]`` (the present modules' A stacked) and
``B_cat [out, R]`` (block-diagonal, scale folded in), one pair of GEMMs per fused projection.

The adapter's identity in the cache key is ``(name, digest)``: ``digest`` is SHA-256 over the
scaling fields of the config and every tensor's name, dtype, shape and bytes in sorted key order,
so new weights under the same name never match KV computed with the old ones.

Every problem with an adapter raises :class:`LoRAError` (a ``ValueError``) naming the file or
tensor at fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from radixkv.errors import LoRAError

from .config import ModelShape

__all__ = ["LoRAAdapter", "LoRABatch", "LoRARegistry", "read_adapter",
           "CONFIG_FILE", "WEIGHTS_FILE", "TARGET_MODULES"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DIGEST_DOMAIN = b"radixkv/lora/v1"

_Fused = dict[str, tuple[torch.Tensor, torch.Tensor]]  # fused group -> (A_cat, B_cat)

# module -> (fused group of the forward, parent in HF naming)
TARGET_MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv", "self_attn"), "k_proj": ("qkv", "self_attn"), "v_proj": ("qkv", "self_attn"),
    "o_proj": ("o", "self_attn"),
    "gate_proj": ("gate_up", "mlp"), "up_proj": ("gate_up", "mlp"), "down_proj": ("down", "mlp"),
}
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight")


def _module_dims(shape: ModelShape) -> dict[str, tuple[str, int, int, int]]:
    """module -> (group, output offset inside the fused group, out_features, in_features)."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q_dim, kv_dim = shape.num_q_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {
        "q_proj": ("qkv", 0, q_dim, hidden),
        "k_proj": ("qkv", q_dim, kv_dim, hidden),
        "v_proj": ("qkv", q_dim + kv_dim, kv_dim, hidden),
        "o_proj": ("o", 0, hidden, q_dim),
        "gate_proj": ("gate_up", 0, inter, hidden),
        "up_proj": ("gate_up", inter, inter, hidden),
        "down_proj": ("down", 0, hidden, inter),
    }


def _group_out(shape: ModelShape) -> dict[str, int]:
    q_dim, kv_dim = shape.num_q_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"qkv": q_dim + 2 * kv_dim, "o": shape.hidden_size,
            "gate_up": 2 * shape.intermediate_size, "down": shape.hidden_size}


@dataclass(eq=False)
class LoRAAdapter:
    """A validated adapter, ready for the forward.

    Attributes:
        name: served name (the request's ``model``).
        path: directory it was read from.
        digest: hex SHA-256 of scaling fields + tensors (see module docstring).
        rank: r.
        alpha: lora_alpha.
        scale: alpha / r, or alpha / sqrt(r) with rsLoRA.
        target_modules: sorted module names the adapter changes.
        layers: per decoder layer, fused group (``qkv``, ``o``, ``gate_up``, ``down``) ->
            ``(A_cat [R, in], B_cat [out, R])`` in the model dtype on the runner device, scale
            folded into ``B_cat``; groups the adapter leaves alone are absent.
    """

    name: str
    path: str
    digest: str
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    layers: list[_Fused] = field(repr=False)

    @property
    def identity(self) -> tuple[str, str]:
        """``(name, digest)``: the adapter part of the cache identity."""
        return (self.name, self.digest)


def _parse_config(path: Path) -> dict:
    """Read and check ``adapter_config.json``; return r, alpha, use_rslora, targets."""
    file = path / CONFIG_FILE
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoRAError(f"{file}: missing (a PEFT adapter needs {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE})") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LoRAError(f"{file}: not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{file}: must hold a JSON object")

    def bad(key: str, why: str) -> LoRAError:
        return LoRAError(f"{file}: '{key}' {why}")

    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise bad("peft_type", f"is {peft_type!r}; only 'LORA' adapters are supported")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    alpha = raw.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise bad("lora_alpha", f"must be a finite number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise bad("use_rslora", f"must be true or false, got {rslora!r}")
    for key, ok, why in (
            ("fan_in_fan_out", lambda v: v in (None, False), "is not supported (Conv1D layout)"),
            ("bias", lambda v: v in (None, "none"), "must be 'none' (adapter biases are not "
                                                    "supported)"),
            ("modules_to_save", lambda v: not v, "is not supported (fully trained modules)"),
            ("use_dora", lambda v: not v, "is not supported (DoRA)"),
            ("rank_pattern", lambda v: not v, "is not supported (per-module ranks)"),
            ("alpha_pattern", lambda v: not v, "is not supported (per-module alphas)"),
            ("layers_to_transform", lambda v: v is None, "is not supported; the weights decide "
                                                          "which layers change")):
        if not ok(raw.get(key)):
            raise bad(key, f"{why}: got {raw.get(key)!r}")
    targets = raw.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGET_MODULES)
    elif isinstance(targets, str):
        targets = [targets]
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) for t in targets)):
        raise bad("target_modules", f"must be a non-empty list of module names, got "
                                    f"{raw.get('target_modules')!r}")
    # PEFT also accepts dotted paths ("model.layers.0.self_attn.q_proj"): the last part names it.
    names = sorted({t.rsplit(".", 1)[-1] for t in targets})
    unknown = [t for t in names if t not in TARGET_MODULES]
    if unknown:
        raise bad("target_modules", f"names modules radixkv cannot adapt: {unknown}; supported: "
                                    f"{sorted(TARGET_MODULES)}")
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return {"r": r, "alpha": float(alpha), "use_rslora": rslora, "targets": tuple(names),
            "scale": float(scale)}


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # deferred: only adapters need it here

    file = path / WEIGHTS_FILE
    if not file.is_file():
        other = " (adapter_model.bin is not supported: save with safetensors)" if (
            path / "adapter_model.bin").exists() else ""
        raise LoRAError(f"{file}: missing{other}")
    try:
        return load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAError(f"{file}: not a readable safetensors file: {exc}") from None


def _digest(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    hasher = hashlib.sha256(_DIGEST_DOMAIN)

    def put(data: bytes) -> None:  # length-prefixed, so no two field lists hash alike
        hasher.update(struct.pack("<Q", len(data)) + data)

    put(json.dumps({k: config[k] for k in ("r", "alpha", "use_rslora", "targets")},
                   sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        put(key.encode())
        put(f"{t.dtype}{tuple(t.shape)}".encode())
        put(t.view(torch.uint8).reshape(-1).numpy().tobytes())
    return hasher.hexdigest()


def read_adapter(name: str, path: str, shape: ModelShape, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read, validate and prepare one PEFT adapter (file I/O: keep it off the event loop).

    Args:
        name: served name.
        path: adapter directory.
        shape: the base model's shape (every tensor is checked against it).
        device / dtype: where and how the forward keeps the weights.

    Raises:
        LoRAError: missing or unreadable files, unsupported config options, unknown target
            modules, a tensor outside the targets or the model's layers, a shape or rank that
            does not match, an A without its B.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise LoRAError(f"{root}: not a directory (a PEFT adapter directory holds {CONFIG_FILE} "
                        f"and {WEIGHTS_FILE})")
    config = _parse_config(root)
    tensors = _load_tensors(root)
    file = root / WEIGHTS_FILE
    r, targets, dims = config["r"], config["targets"], _module_dims(shape)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in sorted(tensors):  # sorted: the same bad file always reports the same error
        tensor = tensors[key]
        m = _KEY.fullmatch(key)
        if m is None:
            why = " (DoRA is not supported)" if "lora_magnitude" in key else ""
            raise LoRAError(f"{file}: unexpected tensor {key!r}{why}; expected "
                            "base_model.model.model.layers.<i>.<self_attn|mlp>.<module>"
                            ".lora_<A|B>.weight")
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in TARGET_MODULES or TARGET_MODULES[module][1] != parent:
            raise LoRAError(f"{file}: tensor {key!r} adapts {parent}.{module}, which radixkv "
                            f"cannot adapt; supported: {sorted(TARGET_MODULES)}")
        if module not in targets:
            raise LoRAError(f"{file}: tensor {key!r} adapts {module}, which is not in "
                            f"target_modules {list(targets)}")
        if layer >= shape.num_layers:
            raise LoRAError(f"{file}: tensor {key!r} is for layer {layer}; the model has "
                            f"{shape.num_layers} layers")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise LoRAError(f"{file}: tensor {key!r} must be a 2-D floating tensor, got "
                            f"{tensor.dtype} {tuple(tensor.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise LoRAError(f"{file}: tensor {key!r} holds NaN or infinite values")
        _, _, out_f, in_f = dims[module]
        expected = (r, in_f) if which == "A" else (out_f, r)
        got = tuple(tensor.shape)
        if got != expected:
            rank = got[0] if which == "A" else got[1]
            io_ok = got[1] == in_f if which == "A" else got[0] == out_f
            if io_ok and rank != r:
                raise LoRAError(f"{file}: rank mismatch: {key!r} has rank {rank} but "
                                f"{CONFIG_FILE} says r={r}")
            raise LoRAError(f"{file}: tensor {key!r} has shape {got}, expected {expected} for "
                            f"{module} of this model (r={r})")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"{file}: holds no LoRA weights")
    absent = sorted(set(targets) - {module for _, module in pairs})
    if absent:  # PEFT saves weights for every target: a listed module without any is a bad file
        raise LoRAError(f"{file}: holds no weights for {absent}, which {CONFIG_FILE} lists in "
                        f"target_modules")
    for (layer, module), pair in sorted(pairs.items()):
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise LoRAError(f"{file}: layer {layer} {module} has no lora_{missing} weight")
    layers = _fuse(pairs, shape, config["scale"], torch.device(device), dtype)
    return LoRAAdapter(name=name, path=str(root), digest=_digest(config, tensors), rank=r,
                       alpha=config["alpha"], scale=config["scale"],
                       target_modules=tuple(sorted({mod for _, mod in pairs})), layers=layers)


def _fuse(pairs: dict[tuple[int, str], dict[str, torch.Tensor]], shape: ModelShape, scale: float,
          device: torch.device, dtype: torch.dtype) -> list[_Fused]:
    """Stack each layer's A's and build block-diagonal scaled B's per fused group."""
    dims, outs = _module_dims(shape), _group_out(shape)
    layers: list[_Fused] = []
    for layer in range(shape.num_layers):
        groups: dict[str, list[tuple[str, dict[str, torch.Tensor]]]] = {}
        for module in TARGET_MODULES:  # fixed order: q, k, v, o, gate, up, down
            pair = pairs.get((layer, module))
            if pair is not None:
                groups.setdefault(dims[module][0], []).append((module, pair))
        fused = {}
        for group, members in groups.items():
            a_cat = torch.cat([p["A"].float() for _, p in members])
            b_cat = torch.zeros(outs[group], a_cat.shape[0], dtype=torch.float32)
            col = 0
            for module, p in members:
                _, offset, out_f, _ = dims[module]
                rank = p["A"].shape[0]
                b_cat[offset:offset + out_f, col:col + rank] = p["B"].float() * scale
                col += rank
            fused[group] = (a_cat.to(device=device, dtype=dtype),
                            b_cat.to(device=device, dtype=dtype))
        layers.append(fused)
    return layers


class LoRABatch:
    """Which packed rows of one forward use which adapter.

    Args:
        adapters: per sequence, its adapter or None (base model).
        qo_indptr: ``[N+1]`` row offsets of the sequences in the packed batch (CPU).
        device: where the row indices go.
    """

    def __init__(self, adapters: Sequence[LoRAAdapter | None], qo_indptr: Sequence[int],
                 device: torch.device | str) -> None:
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        for i, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(
                    range(qo_indptr[i], qo_indptr[i + 1]))
        total = qo_indptr[len(adapters)]
        # rows None: the adapter owns every row, so no gather/scatter is needed.
        self.groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = [
            (adapter, None if len(idx) == total else
             torch.tensor(idx, dtype=torch.int64, device=device))
            for adapter, idx in rows.values()]

    @staticmethod
    def build(adapters: Sequence[LoRAAdapter | None] | None, qo_indptr: Sequence[int],
              device: torch.device | str) -> LoRABatch | None:
        """A LoRABatch, or None when no sequence uses an adapter (the forward then adds nothing)."""
        if not adapters or all(a is None for a in adapters):
            return None
        return LoRABatch(adapters, qo_indptr, device)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> None:
        """``out[rows] += (x[rows] A_cat^T) B_cat^T`` in place for each adapter's rows.

        Args:
            out: ``[T, out]`` the base projection of fused ``group``.
            x: ``[T, in]`` its input.
        """
        for adapter, rows in self.groups:
            weights = adapter.layers[layer].get(group)
            if weights is None:
                continue
            a, b = weights
            if rows is None:
                out.add_(F.linear(F.linear(x, a), b))
            else:
                out.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))


class LoRARegistry:
    """Loaded adapters by name. Not thread-safe: one thread (the event loop, or the offline
    engine's) reads and changes it; requests hold their adapter object, so one that is
    unloaded or replaced keeps working for the requests already using it.

    Args:
        shape / device / dtype: the base model's, for :func:`read_adapter`.
    """

    def __init__(self, shape: ModelShape, *, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        self._adapters: dict[str, LoRAAdapter] = {}

    def read(self, name: str, path: str) -> LoRAAdapter:
        """:func:`read_adapter` for this model (does not register it)."""
        check_name(name)
        return read_adapter(name, path, self.shape, device=self.device, dtype=self.dtype)

    def add(self, adapter: LoRAAdapter, *, replace: bool = False) -> None:
        """Register ``adapter``.

        Raises:
            LoRAError: the name is taken and ``replace`` is False.
        """
        if adapter.name in self._adapters and not replace:
            raise LoRAError(f"lora_name: an adapter named '{adapter.name}' is already loaded; "
                            "unload it first")
        self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> LoRAAdapter:
        """Unregister and return an adapter. Raises KeyError for an unknown name."""
        return self._adapters.pop(name)

    def get(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def list(self) -> list[LoRAAdapter]:
        """Loaded adapters in load order."""
        return list(self._adapters.values())


def check_name(name: object) -> str:
    """An adapter name: 1-128 printable characters, no whitespace.

    Raises:
        LoRAError: naming ``lora_name``.
    """
    if (not isinstance(name, str) or not 1 <= len(name) <= 128 or not name.isprintable()
            or any(c.isspace() for c in name)):
        raise LoRAError(f"lora_name: must be 1-128 printable characters without spaces, got "
                        f"{name!r}")
    return name
