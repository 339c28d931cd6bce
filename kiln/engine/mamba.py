"""The engine's forward over Mamba (v1), token-packed.

A Mamba layer keeps nothing per token: each sequence holds a state slot in the pool (kiln.engine.cache) with
its conv window (the last conv_kernel inputs, the conv weight's dtype) and its selective-scan state
(intermediate x state_size, float32), lent when the sequence starts, copied per completion at a fork, returned
at finish, cancel or preemption (which recomputes from the first token). No prefix is remembered across
requests (a state is not kept at block boundaries).

The norm and in_proj run on fixed tiles (`exact.tiled`), out_proj and the residual too; the conv, x_proj,
dt_proj and the scan run one token of one sequence at a time with the op order of the model's reference scan
(common/ssm.py selective_scan_reference), so a token's numbers have fixed shapes whatever the batch: a prefill
chunk, a decode step and the scoring forward give the same bits, and the model's own forward (which convolves
and scans the whole sequence at once) agrees to fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.engine.cache import BlockPool
from kiln.engine.exact import tiled
from kiln.engine.runner import register
from kiln.engine.state import StateRunner, States
from kiln.models.common.causal_lm import ForCausalLM
from kiln.models.mamba import MambaBackbone, MambaBlock, MambaMixer


@register
class MambaRunner(StateRunner):
    """Runs a ForCausalLM over `MambaBackbone`."""

    families = ("mamba",)
    keeps_prefix_state = True  # engfeat: its state runs through StateRunner._recur (kiln.engine.prefix_state)

    @classmethod
    def accepts(cls, model: nn.Module) -> bool:
        backbone = getattr(model, "model", None)
        return (isinstance(model, ForCausalLM) and type(backbone) is MambaBackbone
                and all(type(layer) is MambaBlock and type(layer.mixer) is MambaMixer for layer in backbone.layers))

    @classmethod
    def refuse(cls, model: nn.Module, name: str) -> str | None:
        return None

    def _setup(self) -> None:
        pass  # every dimension is read from each layer's mixer

    def state_shapes(self, i: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        m = self.backbone.layers[i].mixer
        I, N, _ = m.dims
        return [((I, m.conv1d.weight.shape[-1]), m.conv1d.weight.dtype), ((I, N), torch.float32)]

    def new_pool(self, num_blocks: int, block_size: int, seqs: int = 1) -> BlockPool:
        return self.state_pool(num_blocks, block_size, seqs, [((0,), (0,))] * self.num_layers)

    def _final_norm(self, t: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f(t)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, kv, states: States | None = None) -> torch.Tensor:
        """`states` None: the call is one sequence from its first token (fresh state)."""
        x = self.backbone.embeddings(ids)  # (N, C)
        states = states or self._dense_extras(ids.shape[0])[0]
        for i in range(self.num_layers):
            layer = self.backbone.layers[i]
            m = layer.mixer
            p = tiled(lambda t, layer=layer: layer.mixer.in_proj(layer.norm(t.to(layer.norm.weight.dtype))), x)
            y = self._recur(i, p, m.dims[0], states, lambda st, row, m=m: self._token(m, st, row))

            def post(xt: torch.Tensor, yt: torch.Tensor, layer: MambaBlock = layer) -> torch.Tensor:
                residual = xt.float() if layer.residual_in_fp32 else xt
                return residual + layer.mixer.out_proj(yt)

            x = tiled(post, x, y)
        return x

    @staticmethod
    def _token(m: MambaMixer, state: list[torch.Tensor], row: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One token: [conv window (I, K), scan state (I, N)] and its in_proj row (2I,) -> the new ones and the
        gated output (I,), in the reference scan's op order."""
        conv, h = state
        I, N, R = m.dims
        u, z = row.split([I, I])
        window = torch.cat([conv[:, 1:], u[:, None].to(conv.dtype)], 1)  # the last K inputs
        u = m.act(F.conv1d(window[None], m.conv1d.weight, m.conv1d.bias, groups=I))[0, :, 0].to(row.dtype)
        dt, B, C = m.x_proj(u[None])[0].split([R, N, N])
        dt = (m.dt_proj.weight @ dt[:, None])[:, 0]  # (I,); its bias goes in below
        dt = F.softplus(dt + m.dt_proj.bias.float())
        A = -torch.exp(m.A_log.float())  # (I, N)
        decay = torch.exp(A * dt[:, None])
        drive = dt[:, None] * B[None].float() * u[:, None].float()  # (dt * B) * u, as the reference
        h = decay * h + drive
        y = torch.matmul(h.to(row.dtype), C[:, None])[:, 0]  # (I,)
        y = y + u * m.D.float()
        return [window, h], (y * F.silu(z)).to(row.dtype)
