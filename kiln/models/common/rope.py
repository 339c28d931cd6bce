"""Rotary position embeddings: inverse frequencies per `rope_type`, cos/sin tables, rotate_half;
partial rotary (only the first dims of a head turn) and the multimodal (3-axis) variant.

Supported `rope_type`s: default, linear, llama3 (Llama 3.1 smooth wavelength scaling) and yarn
(NTK-by-parts with an attention factor on cos/sin). Frequencies are computed once on the CPU in
float32 with the same expressions transformers uses, so the tables are bit-identical.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kiln.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by `factor`, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, p: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    old_len = p["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / old_len

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = float(yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"]))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 where the dimension extrapolates (high frequency), 0 where it interpolates
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def rope_parameters(raw: dict[str, Any] | None, legacy: dict[str, Any], max_positions: int,
                    default_theta: float = 10000.0, source: str = "config.json") -> dict[str, Any]:
    """The effective rope dict: `rope_parameters`, else legacy `rope_scaling` + `rope_theta` keys."""
    p = dict(raw or legacy.get("rope_scaling") or {})
    p.setdefault("rope_type", p.get("type", "default"))
    p.setdefault("rope_theta", legacy.get("rope_theta", default_theta))
    if p["rope_type"] not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope_type {p['rope_type']!r} is not supported; choose one of: {', '.join(ROPE_TYPES)}")
    if p["rope_type"] in ("llama3", "yarn"):
        p.setdefault("original_max_position_embeddings", legacy.get("original_max_position_embeddings", max_positions))
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(p["rope_type"], ())
    missing = [k for k in need if k not in p]
    if missing:
        raise ConfigError(f"{source}: rope_parameters of type {p['rope_type']!r} needs {', '.join(missing)}")
    theta = p["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        # a zero, negative or NaN base turns every position into NaN: each step would be skipped, none said why
        raise ConfigError(f"{source}: rope_theta must be a finite number > 0, got {theta!r}")
    return p


class RotaryEmbedding(nn.Module):
    """position_ids (B, T) -> cos, sin (B, T, head_dim), scaled by the rope type's attention factor."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_positions: int):
        super().__init__()
        theta, kind = float(params["rope_theta"]), params["rope_type"]
        self.attention_scaling = 1.0
        if kind == "yarn":
            inv_freq, self.attention_scaling = _yarn(theta, head_dim, params, max_positions)
        else:
            inv_freq = _base_inv_freq(theta, head_dim)
            if kind == "linear":
                inv_freq = inv_freq / params["factor"]
            elif kind == "llama3":
                inv_freq = _llama3(inv_freq, params)
        # A plain attribute, not a buffer: built on the CPU even under a meta-device build, never saved.
        self.inv_freq = inv_freq
        self._on: dict[torch.device, torch.Tensor] = {}

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._on.get(x.device)
        if inv_freq is None:
            inv_freq = self._on[x.device] = self.inv_freq.to(x.device)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # (B, 1, T, D): broadcast over heads
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def apply_rope_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary dims stored as adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's layout).

    Each pair turns by one frequency; the result comes out de-interleaved (first members of the
    pairs, then second members), as transformers returns it, so q.k products match its own.
    """
    half = cos.shape[-1] // 2  # cos/sin are cat(freqs, freqs): the first half holds each pair's angle
    cos, sin = cos[..., :half].unsqueeze(unsqueeze_dim), sin[..., :half].unsqueeze(unsqueeze_dim)

    def turn(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return turn(q), turn(k)


def apply_partial_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate only the first cos.shape[-1] dims of each head (partial rotary); the rest pass through."""
    d = cos.shape[-1]
    q_rot, k_rot = apply_rope(q[..., :d], k[..., :d], cos, sin)
    return torch.cat([q_rot, q[..., d:]], dim=-1), torch.cat([k_rot, k[..., d:]], dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary (Qwen3-VL / Qwen3.5, interleaved sections): positions (3, B, T) for time, height, width.

    Frequency i turns by the height position when i % 3 == 1 and i < 3 * sections[1], by the width
    position when i % 3 == 2 and i < 3 * sections[2], else by the time position. Text tokens carry
    the same position on all three axes, so (B, T) positions give plain rotary tables.
    """

    def __init__(self, head_dim: int, params: dict[str, Any], max_positions: int):
        super().__init__(head_dim, params, max_positions)
        self.sections = list(params.get("mrope_section") or [11, 11, 10])

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 2:
            return super().forward(x, position_ids)
        inv_freq = self._on.get(x.device)
        if inv_freq is None:
            inv_freq = self._on[x.device] = self.inv_freq.to(x.device)
        freqs = position_ids.expand(3, -1, -1)[..., None].float() * inv_freq  # (3, B, T, D/2)

        def merge(f: torch.Tensor) -> torch.Tensor:
            out = f[0].clone()
            for axis in (1, 2):
                idx = slice(axis, self.sections[axis] * 3, 3)
                out[..., idx] = f[axis, ..., idx]
            return torch.cat((out, out), dim=-1)  # (B, T, D)

        cos = merge(freqs.cos() * self.attention_scaling)
        sin = merge(freqs.sin() * self.attention_scaling)
        return cos.to(x.dtype), sin.to(x.dtype)


class PairRotaryEmbedding(RotaryEmbedding):
    """position_ids (B, T) -> cos, sin (B, T, rope_dim / 2): one angle per interleaved pair (DeepSeek-V4).

    The tables are not doubled; `apply_rope_tail` expands them next to the rotation.
    """

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._on.get(x.device)
        if inv_freq is None:
            inv_freq = self._on[x.device] = self.inv_freq.to(x.device)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, rope_dim / 2)
        return (freqs.cos() * self.attention_scaling).to(x.dtype), (freqs.sin() * self.attention_scaling).to(x.dtype)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): each adjacent pair turned by 90 degrees."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] dims of x as adjacent pairs (heads laid out [nope | rope]).

    Half-size tables from `PairRotaryEmbedding`; the rotation runs in float32 and is cast back, the
    leading dims pass through. Calling it with -sin undoes it (DeepSeek-V4 de-rotates its attention output).
    """
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    d = cos.shape[-1]
    rope = x[..., -d:]
    turned = ((rope.float() * cos) + (_rotate_pairs(rope).float() * sin)).to(x.dtype)
    return torch.cat([x[..., :-d], turned], dim=-1)
