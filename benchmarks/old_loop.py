"""kiln's generation loop before the engine, kept here as the benchmarks' measured "before" baseline (a helper,
not a benchmark).

This is a copy of what kiln ran before its generation engine (kiln.engine): `generate`, the static-batch loop of
`kiln.models.common.generation` (one prefill over the left-padded batch, then one token per row a step, the KV
cache of the model's own `new_cache`, finished rows padded while the others run), and GRPO's rollout on it
(`RolloutModel`: the backbone then the LM head at the last position, packed by MKL for the decode's row count on
the CPU; `sample`: the loop path of kiln.train.grpo_rollout.GRPORun.sample, the sampler's log-probs at the
temperature, one generator shared by the micro-batch). kiln retires that loop (issue 39: "the old loop removed
once nothing uses it"), so the benchmarks that compare against it (bench_engine.py's `old` side, bench_grpo.py's
`old` side) measure this copy: the same code, not a re-implementation, and it stays as it was when kiln changes.
It runs kiln's model forward (which is what it measures) and kiln's sampling helpers (`filter_logits`,
`inverse_cdf`), nothing of kiln's generation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.models.common.causal_lm import CausalLMOutput, ForCausalLM
from kiln.models.generation import filter_logits, inverse_cdf


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None,
             draw: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Prompt ids (B, T) -> (B, T + n) with n <= max_new_tokens; `on_token` sees each new (B,) column; `draw`
    (with do_sample): float32 logits (B, V) -> (B,) token ids in place of the seeded multinomial draw."""
    config = model.config
    eos = eos_token_id if eos_token_id is not None else config.eos_token_id
    eos_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                           device=input_ids.device)
    pad = pad_token_id if pad_token_id is not None else (config.pad_token_id if config.pad_token_id is not None
                                                         else (int(eos_ids[0]) if len(eos_ids) else 0))
    device = input_ids.device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None and draw is None else None
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (B, T)
    cache = model.new_cache()  # None: no incremental state, every step re-reads the sequence
    was_training = model.training
    model.eval()
    out, step_ids = input_ids, input_ids
    unfinished = torch.ones(input_ids.size(0), dtype=torch.bool, device=device)
    try:
        for _ in range(max_new_tokens):
            logits = model(step_ids, attention_mask=mask, position_ids=positions, cache=cache,
                           logits_to_keep=1).logits[:, -1, :].to(dtype=torch.float32)  # (B, V)
            if do_sample and draw is not None:
                token = draw(logits)
            elif do_sample:
                probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
                token = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                token = logits.argmax(-1)
            token = torch.where(unfinished, token, torch.full_like(token, pad))
            out = torch.cat([out, token[:, None]], dim=-1)
            if on_token is not None:
                on_token(token)
            if len(eos_ids):
                unfinished &= ~torch.isin(token, eos_ids)
                if not bool(unfinished.any()):
                    break
            mask = torch.cat([mask, mask.new_ones(mask.size(0), 1)], dim=-1)
            if cache is not None:
                step_ids, positions = token[:, None], positions[:, -1:] + 1
            else:
                step_ids, positions = out, torch.cat([positions, positions[:, -1:] + 1], dim=-1)
    finally:
        model.train(was_training)
    return out


class RolloutModel:
    """GRPO's decoder on the old loop: the backbone, then the LM head at the last position alone; on the CPU with a
    plain float32 head, the head's weight packed by MKL for the decode's row count (where MKL is there)."""

    def __init__(self, core: nn.Module):
        self.model, self.config, self.sharded = core, core.config, False
        self.packed: tuple[int, torch.Tensor] | None = None
        try:
            self.ops = (torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear) \
                if torch.backends.mkl.is_available() else None
        except (AttributeError, RuntimeError):
            self.ops = None
        head, weight = getattr(core, "lm_head", None), getattr(core, "output_weight", None)
        if not (isinstance(core, ForCausalLM) and core.fast and type(core).forward is ForCausalLM.forward
                and type(core).head is ForCausalLM.head and (head is None or type(head) is nn.Linear)
                and type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype == torch.float32
                and weight.device.type == "cpu"):
            self.ops = None
        self.weight, self.bias = weight, None if head is None else head.bias

    @property
    def training(self) -> bool:
        return self.model.training

    def new_cache(self) -> Any:
        return self.model.new_cache()

    def eval(self) -> None:
        self.model.eval()

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def __call__(self, input_ids, *, attention_mask, position_ids, cache, logits_to_keep, **extra) -> Any:
        if self.ops is None or extra or torch.is_autocast_enabled("cpu"):
            return self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                              logits_to_keep=logits_to_keep, **extra)
        hidden = self.model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache)[:, -1].contiguous()
        pack, linear = self.ops
        rows = hidden.size(0)
        if self.packed is None or self.packed[0] != rows:
            self.packed = (rows, pack(self.weight, rows))
        return CausalLMOutput(logits=linear(hidden, self.packed[1], self.weight, self.bias, rows)[:, None])


def completion_mask(completions: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """(N, C) long: 1 up to and including each row's first EOS (every token where there is none)."""
    is_eos = torch.isin(completions, torch.tensor(eos_ids, device=completions.device)) if eos_ids else \
        torch.zeros_like(completions, dtype=torch.bool)
    c = completions.size(1)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(completions[:, 0], c))
    return (torch.arange(c, device=completions.device)[None, :] <= first[:, None]).long()


def sample(self: Any, decoder: Any, rows: list[int], prompts: Any, repeat: int, seed: int | None,
           device: torch.device) -> dict[str, Any]:
    """GRPORun.sample's loop path (`self` a kiln.train.grpo_rollout.GRPORun, `decoder` a RolloutModel): the
    completions of `rows` (`repeat` each) drawn from one generator for the micro-batch, their log-probs at the
    temperature, scored by the run's rewards (GRPORun._scored)."""
    g, core = self.g, decoder.model
    ids, mask = prompts.left_padded(rows, repeat, self.pad_id(core), device)
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    steps: list[torch.Tensor] = []

    def draw(logits: torch.Tensor) -> torch.Tensor:  # (N, V) float32 -> (N,)
        logp = (logits if g.temperature == 1 else logits / g.temperature).log_softmax(-1)
        kept = filter_logits(logp, 1.0, g.top_k, g.top_p) if g.top_k or g.top_p < 1 else logp
        token = inverse_cdf(kept.exp(), gen)
        steps.append(logp.gather(1, token[:, None]).squeeze(1))
        return token

    out = generate(decoder, ids, mask, max_new_tokens=g.max_new_tokens, do_sample=seed is not None, draw=draw,
                   pad_token_id=self.pad_id(core))
    completions = out[:, ids.size(1):]
    cmask = completion_mask(completions, self.eos_ids(core))
    eos = torch.tensor(self.eos_ids(core), device=completions.device, dtype=torch.long)
    truncated = ~torch.isin(completions, eos).any(1)
    logps = torch.stack(steps, 1) * cmask if steps else torch.zeros_like(cmask, dtype=torch.float)
    return self._scored(rows, prompts, repeat, ids, mask, completions, cmask, truncated, logps, core)


def install() -> None:
    """Make GRPO's rollouts in this process run on this copy of the old loop (bench_grpo.py's `old` side): every
    rollout's decoder a RolloutModel, its sampling `sample`; the trainer's log-probs through the training forward
    (no engine: `exact` is off)."""
    from kiln.train.grpo_rollout import GRPORun

    GRPORun.decoder = lambda self, core, sharded, main=True: RolloutModel(core)  # type: ignore[method-assign]
    GRPORun.sample = sample  # type: ignore[method-assign]
    GRPORun.exact = lambda self, model: False  # type: ignore[method-assign]
