"""Rotary position embeddings, rotate-half layout (as transformers; the GGUF loader undoes
llama.cpp's interleaved permutation of Q/K so both formats use this one).

Scaling follows transformers' definitions: linear (positions / factor), llama3 (per-frequency
wavelength-dependent factors), YaRN (interpolated and extrapolated frequencies blended over a
ramp, cos and sin scaled by its attention factor), longrope (Phi-3's per-frequency short/long
factors and attention factor) and dynamic NTK. Dynamic NTK is computed *per token* from its own
position: a token's key is cached once, so its rotation must not depend on what else is in the
batch. This equals transformers' token-by-token decode exactly.
"""

from __future__ import annotations

import math

import torch

from kvserve.engine.model.model_config import ModelConfig


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # On the CPU explicitly: a model is built on the meta device before its weights load, and
    # these tables come from the config, not the checkpoint (the loader moves them to the device).
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Long wavelengths are divided by `factor`, short ones kept, those between interpolated."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor) as transformers' YaRN computes them: frequencies
    that turn fewer than beta_slow times over the original context are interpolated (/ factor),
    those turning more than beta_fast times kept, those between blended linearly."""
    factor, original = float(scaling["factor"]), int(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001), 0, 1)
    extrapolated = 1 - ramp
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, float(attention_factor)


def longrope_parameters(scaling: dict, max_position_embeddings: int) -> tuple[tuple[float, ...], float]:
    """Phi-3's LongRoPE: (the per-frequency factors, the cos/sin attention factor). The long
    factors serve a model whose context reaches past its original pretraining length, as
    llama.cpp decides once from the context (transformers picks per forward from the longest
    position in its batch, which a paged cache cannot follow: a token's key is rotated once)."""
    original = int(scaling["original_max_position_embeddings"])
    long = max_position_embeddings > original
    factors = tuple(float(f) for f in scaling["long_factor" if long else "short_factor"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(scaling.get("factor") or max_position_embeddings / original)
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return factors, float(attention_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin computed in float32 from integer positions, for q [T, H, D] and k [T, Hkv, D]."""

    def __init__(self, config: ModelConfig, rotary_dim: int | None = None) -> None:
        """`rotary_dim`: the leading dims of each head that rotate (all of them by default)."""
        super().__init__()
        self.head_dim = rotary_dim or config.head_dim
        self.theta = config.rope_theta
        self.max_position_embeddings = config.max_position_embeddings
        scaling = dict(config.rope_scaling or {})
        self.rope_type = scaling.pop("rope_type", "default")
        self.factor = float(scaling.get("factor", 1.0))
        self.attention_factor = 1.0  # multiplies cos and sin (LongRoPE, YaRN)
        inv_freq = base_inv_freq(self.head_dim, config.rope_theta)
        if self.rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, self.factor, float(scaling["low_freq_factor"]),
                                       float(scaling["high_freq_factor"]),
                                       int(scaling["original_max_position_embeddings"]))
        elif self.rope_type == "linear":
            inv_freq = inv_freq / self.factor  # same as positions / factor, rounded as transformers does
        elif self.rope_type == "longrope":
            factors, self.attention_factor = longrope_parameters(scaling, config.max_position_embeddings)
            if len(factors) != inv_freq.shape[0]:
                raise ValueError(f"longrope needs {inv_freq.shape[0]} factors (rotary dims / 2), got {len(factors)}")
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
        elif self.rope_type == "yarn":
            inv_freq, self.attention_factor = yarn_inv_freq(inv_freq, config.head_dim, config.rope_theta, scaling)
        if config.rope_freq_factors is not None:
            # Per-frequency divisors from a GGUF's `rope_freqs.weight` (llama.cpp's encoding of
            # llama3 scaling), applied on top of the config's scaling.
            factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
            if factors.shape != inv_freq.shape:
                raise ValueError(f"rope frequency factors must have shape {tuple(inv_freq.shape)}, got {tuple(factors.shape)}")
            inv_freq = inv_freq / factors
        # A buffer so that it follows .to(device); not persistent: it is derived from the config,
        # and keeping it out of the state dict keeps it float32 when weights are bfloat16.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:  # [T, D/2] float32
        pos = positions.float()
        if self.rope_type == "dynamic":
            # transformers: base *= (factor * L / max_pos - (factor - 1)) ** (D / (D - 2)), with
            # L = max(seq_len, max_pos); per token, seq_len = position + 1.
            length = torch.clamp(pos + 1, min=self.max_position_embeddings)
            dim = self.head_dim
            base = self.theta * (self.factor * length / self.max_position_embeddings - (self.factor - 1)) ** (dim / (dim - 2))
            exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=pos.device).float() / dim
            inv_freq = 1.0 / base.unsqueeze(1) ** exponents.unsqueeze(0)
            return pos.unsqueeze(1) * inv_freq
        return torch.outer(pos, self.inv_freq.float())

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for the tokens at `positions`: computed once per forward, shared by all layers."""
        freqs = self._freqs(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D]; cos, sin [T, R], broadcast over heads. R < D (partial rotary,
    Phi-3's partial_rotary_factor): the first R dims of each head rotate, the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    return (torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1),
            torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1))
