"""Mamba (v1): a stack of pre-RMSNorm residual blocks whose mixer is a selective state-space model.

Choices (transformers' `model_type: mamba`):
  x = embed(ids);  each layer: x = x + mixer(rmsnorm(x))  (residual kept in fp32 when residual_in_fp32);
  out = rmsnorm_f(x);  logits = out @ W_head^T (W_head = the embeddings when tied), returned in fp32.
Mixer: in_proj -> (u, z) each of width I = expand * hidden; u -> causal depthwise conv1d (kernel
conv_kernel) -> act -> x_proj gives (dt_raw of rank R, B, C of size state_size); dt = dt_proj.weight @ dt_raw,
softplus(dt + dt_proj.bias); A = -exp(A_log); selective scan (common/ssm.py) with skip D and gate silu(z);
out_proj back to hidden. Padded positions (attention_mask = 0) are zeroed before in_proj and after the conv.
The scan is chosen by the kiln-only `scan` field: "reference" (bit-identical to transformers) or "fast".
No incremental-decoding cache: forward (and each generation step) runs the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.models.common.activations import activation
from kiln.models.common.causal_lm import DecoderModel, ForCausalLM
from kiln.models.common.norms import RMSNorm
from kiln.models.common.ssm import SCANS, causal_conv1d
from kiln.models.config import FamilyConfig
from kiln.models.keymap import KeyMap
from kiln.models.parallel_plan import ParallelPlan
from kiln.models.pretrained import Family, TaskSpec, Tiny
from kiln.models.tasks import BASE, CAUSAL_LM


@dataclass
class MambaConfig(FamilyConfig):
    model_type = "mamba"

    vocab_size: int = 50280
    hidden_size: int = 768
    state_size: int = 16
    num_hidden_layers: int = 32
    layer_norm_epsilon: float = 1e-5
    pad_token_id: int | None = 0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    expand: int = 2
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    initializer_range: float = 0.1
    residual_in_fp32: bool = True
    time_step_rank: int | str = "auto"
    time_step_scale: float = 1.0
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_init_scheme: str = "random"
    time_step_floor: float = 1e-4
    rescale_prenorm_residual: bool = False
    scan: str = "reference"  # kiln only, never written to config.json: "reference" | "fast"

    @property
    def intermediate_size(self) -> int:
        return int(self.expand * self.hidden_size)

    @property
    def dt_rank(self) -> int:
        return math.ceil(self.hidden_size / 16) if self.time_step_rank == "auto" else int(self.time_step_rank)

    def validate(self, source: str = "config.json") -> None:
        self.extra.pop("intermediate_size", None)  # derived from expand * hidden_size, as transformers does
        if self.scan not in SCANS:
            raise ConfigError(f"{source}: scan {self.scan!r} is not one of: {', '.join(SCANS)}")
        if self.time_step_rank != "auto" and not (isinstance(self.time_step_rank, int) and self.time_step_rank > 0):
            raise ConfigError(f"{source}: time_step_rank must be 'auto' or a positive integer, got {self.time_step_rank!r}")
        if self.time_step_init_scheme not in ("random", "constant"):
            raise ConfigError(f"{source}: time_step_init_scheme {self.time_step_init_scheme!r} is not 'random' or 'constant'")
        for key in ("hidden_size", "state_size", "num_hidden_layers", "expand", "conv_kernel", "vocab_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{source}: {key} must be >= 1, got {getattr(self, key)}")
        activation(self.hidden_act)  # raises on an unknown act, naming the supported ones

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("scan")
        out["intermediate_size"] = self.intermediate_size
        out["time_step_rank"] = self.dt_rank  # transformers writes the resolved rank
        return out


def mask_padding(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded positions of x (B, T, C); 1/0 mask (B, T). Keeps x's dtype."""
    if attention_mask is None:
        return x
    return (x * attention_mask[:, :, None]).to(x.dtype)


class MambaMixer(nn.Module):
    def __init__(self, c: MambaConfig):
        super().__init__()
        I, N, R = c.intermediate_size, c.state_size, c.dt_rank
        self.dims = (I, N, R)
        self.in_proj = nn.Linear(c.hidden_size, 2 * I, bias=c.use_bias)
        self.conv1d = nn.Conv1d(I, I, c.conv_kernel, groups=I, padding=c.conv_kernel - 1, bias=c.use_conv_bias)
        self.act = activation(c.hidden_act)
        self.x_proj = nn.Linear(I, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, I, bias=True)
        self.A_log = nn.Parameter(torch.empty(I, N))
        self.D = nn.Parameter(torch.empty(I))
        self.out_proj = nn.Linear(I, c.hidden_size, bias=c.use_bias)
        self.scan = c.scan
        self._init = (c.dt_rank ** -0.5 * c.time_step_scale, c.time_step_init_scheme, c.time_step_min,
                      c.time_step_max, c.time_step_floor, c.num_hidden_layers if c.rescale_prenorm_residual else 0)

    def after_init(self) -> None:
        """Mamba's own init after the generic normal(0, std): S4D-real A, unit D, dt spread in [min, max]."""
        I, N, _ = self.dims
        dt_std, scheme, dt_min, dt_max, dt_floor, rescale_layers = self._init
        self.A_log.copy_(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).expand(I, N))
        nn.init.ones_(self.D)
        if scheme == "constant":
            nn.init.constant_(self.dt_proj.weight, dt_std)
        else:
            nn.init.uniform_(self.dt_proj.weight, -dt_std, dt_std)
        dt = torch.exp(torch.rand(I) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt): softplus(bias) starts at dt
        nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))
        if self.conv1d.bias is not None:
            nn.init.zeros_(self.conv1d.bias)
        nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))
        if rescale_layers:
            self.out_proj.weight /= math.sqrt(rescale_layers)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        _I, N, R = self.dims
        dtype = x.dtype
        xz = self.in_proj(mask_padding(x, attention_mask)).transpose(1, 2)  # (B, 2I, T)
        A = -torch.exp(self.A_log.float())  # (I, N)
        u, z = xz.chunk(2, dim=1)  # (B, I, T) each
        u = causal_conv1d(u, self.conv1d.weight, self.conv1d.bias, self.act)
        u = mask_padding(u.transpose(1, 2), attention_mask)  # (B, T, I)
        dt, B, C = torch.split(self.x_proj(u), [R, N, N], dim=-1)  # (B, T, R), (B, T, N), (B, T, N)
        dt = self.dt_proj.weight @ dt.transpose(1, 2)  # (I, R) @ (B, R, T) -> (B, I, T); bias goes in the scan
        y = SCANS[self.scan](u.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), z,
                             self.dt_proj.bias.float())  # (B, I, T)
        return self.out_proj(y.transpose(1, 2).to(dtype))  # (B, T, C)


class MambaBlock(nn.Module):
    def __init__(self, c: MambaConfig):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, eps=c.layer_norm_epsilon)
        self.mixer = MambaMixer(c)
        self.residual_in_fp32 = c.residual_in_fp32

    def residual_outputs(self) -> list[nn.Linear]:
        """The projections whose zeroing turns this block into the identity (used by layer growth)."""
        return [self.mixer.out_proj]

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        residual = x.float() if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.to(self.norm.weight.dtype)), attention_mask)


class MambaBackbone(nn.Module):
    def __init__(self, c: MambaConfig):
        super().__init__()
        self.embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(c) for _ in range(c.num_hidden_layers))
        self.norm_f = RMSNorm(c.hidden_size, eps=c.layer_norm_epsilon)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The embeddings under the other decoders' name (kiln.engine reads `model.model.embed_tokens`); not a
        module of its own: state dicts and key maps see `embeddings` alone."""
        return self.embeddings

    def new_cache(self) -> None:
        """No incremental-decoding state: generation feeds the whole sequence each step."""
        return None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                cache: None = None) -> torch.Tensor:
        # position_ids (packed token-shard windows) are accepted and unused: an SSM has no positions.
        if cache is not None:
            raise ConfigError("Mamba keeps no decoding cache; pass cache=None")
        if (input_ids is None) == (inputs_embeds is None):
            raise ConfigError("pass exactly one of input_ids or inputs_embeds")
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.norm_f(x)


# kiln name (under `model.`) <-> HF name (under `backbone.`): the same module names as transformers.
BASE_KEYS = KeyMap([
    ("embeddings", "embeddings"),
    ("embeddings", "embedding"),  # state-spaces checkpoints say `embedding`; read them, write `embeddings`
    ("layers.{}", "layers.{}"),
    ("norm_f", "norm_f"),
])

# expand 2 -> 64 channels, 8 states, rank-2 dt, kernel 4, tied; parity also runs an untied, biased variant.
TINY = Tiny(dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4),
            specials={"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},  # pad 0
            variants={"untied-biased": dict(tie_word_embeddings=False, use_bias=True, use_conv_bias=False,
                                            time_step_rank=3, expand=3, residual_in_fp32=False)})

FAMILY = Family(
    model_type="mamba",
    config_cls=MambaConfig,
    hf_prefix="backbone",
    base_keys=BASE_KEYS,
    parallel_plan=ParallelPlan(blocks="model.layers"),  # FSDP units and checkpointing only: no TP plan
    tasks={
        BASE: TaskSpec("MambaModel", lambda c: DecoderModel(MambaBackbone(c))),
        CAUSAL_LM: TaskSpec(
            "MambaForCausalLM",
            # Mamba: the head reads the hidden state in its own dtype and returns float32 logits
            lambda c: ForCausalLM(MambaBackbone(c), c.hidden_size, c.vocab_size, c.tie_word_embeddings,
                                  embedding="embeddings", fp32_logits=True),
            KeyMap([("lm_head", "lm_head")])),
    },
    tiny=TINY,
)
