"""Pipeline parallelism: a causal LM's blocks split into stages over the "pp" ranks, run by the
schedules of torch.distributed.pipelining ("gpipe", "1f1b", and "interleaved": two virtual stages
per rank, rank r running stages r and r + pp).

Each rank keeps only what its stages own, under the original names: `layers` becomes a ModuleDict
keyed by layer index holding this rank's blocks, the embedding stays on the rank of stage 0, the
final norm and the head on the rank of the last stage. `model.state_dict()` is then this rank's
slice of the full one, so sharded checkpoints (DCP) save per stage and gather by name.

A stage runs the family's own backbone forward over a view that holds only its blocks: stage 0
from token ids, later stages from the hidden states (B, T, C) the previous stage sent (the only
tensor that crosses a stage boundary). Every stage gets the micro-batch's position ids and
attention mask as schedule kwargs (all stages of a pipeline read the same rows) and recomputes the
rotary tables and the causal mask itself. The last stage applies the final norm and the head and
returns the cross entropy SUMMED over its micro-batch's targets; gradients therefore accumulate
sums, and the caller divides by the global target count, the Trainer's (sum, count) contract.

Tied input/output embeddings: the rank of the last stage keeps a copy of the embedding (under its usual
name) for the head; after each step the two copies' gradients are summed between the first and the last
stage of each dp group, so both take the same update and stay identical (the norm counts it once).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from kiln.constants import IGNORE_INDEX
from kiln.errors import ConfigError, KilnError
from kiln.models.common.causal_lm import CausalLMOutput
from kiln.models.common.config import text_sizes
from kiln.models.common.loss import shift_labels
from kiln.models.pretrained import PreTrainedModel
from kiln.parallel.blocks import apply_activation_checkpointing, model_name, plan_of
from kiln.parallel.fsdp import DTYPES, apply_fsdp
from kiln.parallel.grads import scale_to_norm

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def stage_sizes(num_blocks: int, pp: int, schedule: str, given: list[int] | None, name: str) -> list[int]:
    """Blocks per stage (2 x pp virtual stages for "interleaved"), checked against the model's block count."""
    stages = pp * (2 if schedule == "interleaved" else 1)
    if given is not None:
        if schedule == "interleaved":
            raise ConfigError("parallel.pp_stages is for the gpipe and 1f1b schedules; 'interleaved' splits the "
                              f"blocks evenly over its 2 x pp = {stages} virtual stages")
        if sum(given) != num_blocks:
            raise ConfigError(f"parallel.pp_stages {given} adds up to {sum(given)} blocks but {name} has "
                              f"{num_blocks}; give block counts that add up to {num_blocks}")
        return list(given)
    if stages > num_blocks:
        what = f"parallel.pp = {pp}" if stages == pp else f"2 x parallel.pp = {stages} interleaved stages"
        raise ConfigError(f"{what} is more than the {num_blocks} blocks of {name}; every stage needs at least "
                          f"one block (choose pp <= {num_blocks if stages == pp else num_blocks // 2})")
    # earlier stages take the remainder: the last one also runs the head and the loss
    return [num_blocks // stages + (1 if i < num_blocks % stages else 0) for i in range(stages)]


def _parts(model: nn.Module) -> tuple[nn.Module, str, str, str]:
    """(backbone, blocks, embedding, final norm attribute names) from the family's parallel plan."""
    plan = plan_of(model)
    name = model_name(model)
    if plan is None or plan.embedding is None or plan.final_norm is None or plan.lm_head is None:
        raise ConfigError(f"parallel.pp needs a family whose parallel plan names its blocks, embedding, final norm "
                          f"and lm_head; {name}'s does not")
    if output_router := getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ConfigError(f"parallel.pp does not add the MoE router's auxiliary loss (output_router_logits = "
                          f"{output_router}); set it false or train without pp")
    base, blocks = plan.blocks.rsplit(".", 1)
    attrs = []
    for path in (plan.embedding, plan.final_norm):
        owner, attr = path.rsplit(".", 1)
        if owner != base:
            raise ConfigError(f"parallel.pp: {name}'s plan puts {path} outside its backbone {base}")
        attrs.append(attr)
    return model.get_submodule(base), blocks, attrs[0], attrs[1]


class _CausalLM(Protocol):
    """What the pipeline reads and cuts of the model it splits: a causal LM (its plan names an lm_head)."""
    lm_head: nn.Module | None

    def head_loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class _MainLayers(Protocol):
    num_main_layers: int  # a backbone whose multi-token-prediction layers follow its main ones


class Stage(nn.Module):
    """One pipeline stage: a view of the backbone holding only its blocks, plus the head on the last stage."""
    head_loss_sum: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def __init__(self, view: nn.Module, lm: nn.Module, first: bool, last: bool, dtype: torch.dtype,
                 tied_embedding: nn.Module | None = None):
        super().__init__()
        self.model = view
        self.lm_head = lm.lm_head if last else None
        self.tied_embedding = tied_embedding  # the head's weight when tied: registered here for FSDP to shard
        self.first, self.last, self.dtype = first, last, dtype
        # a bound method, not a submodule: lm's head is self.lm_head (cast: _parts accepted lm as a causal LM)
        self.head_loss_sum = cast(_CausalLM, lm).head_loss_sum

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        source = {"input_ids": x} if self.first else {"inputs_embeds": x}  # token ids (B, T) or hidden (B, T, C)
        hidden = self.model(**source, attention_mask=attention_mask, position_ids=position_ids)  # (B, T, C)
        if not self.last:
            return hidden.to(self.dtype)  # the dtype the next stage's receive buffer was made with
        assert targets is not None, "the last stage is run with the targets its loss sums over"
        loss_sum, _ = self.head_loss_sum(hidden, targets)
        return torch.stack([loss_sum.float()])  # (1,): a new tensor, not a view (FSDP hooks the output)


def _view(backbone: nn.Module, blocks_attr: str, blocks: list[nn.Module], embed_attr: str, norm_attr: str,
          first: bool, last: bool, main_layers: bool) -> nn.Module:
    """A shallow copy of the backbone (same class, same forward) whose module table holds only this stage's parts."""
    view = copy.copy(backbone)
    view._modules = dict(backbone._modules)
    view._parameters, view._buffers = dict(backbone._parameters), dict(backbone._buffers)
    setattr(view, blocks_attr, nn.ModuleList(blocks))
    if main_layers:  # a backbone that runs only its first N layers (multi-token-prediction layers follow)
        cast(_MainLayers, view).num_main_layers = len(blocks)  # cast: main_layers says the backbone has it
    if not first:
        setattr(view, embed_attr, None)
    if not last:
        setattr(view, norm_attr, nn.Identity())
    return view


@dataclass
class Pipeline:
    """This rank's stages and schedule, and the gradient bookkeeping around them."""
    stages: list[Stage]
    indices: list[int]               # the stage index of each of this rank's stages
    num_stages: int
    schedule_name: str
    microbatches: int
    mesh: DeviceMesh
    fsdp: bool
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    tie_group: Any = None                    # first and last stage of this dp group, when embeddings are tied
    tied_copy: nn.Parameter | None = None    # the last stage's copy of the embedding (counted once in the norm)
    embedding_weight: nn.Parameter | None = None  # the first stage's, when tied

    def __post_init__(self) -> None:
        self.group = self.mesh.get_group("pp")
        names = self.mesh.mesh_dim_names
        assert names is not None, "the pipeline's mesh names its dims (pp, dp)"
        self.pp = self.mesh.size(names.index("pp"))
        self.dp = self.mesh.size(names.index("dp"))
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.schedules: dict[int, Any] = {}   # one per sequence length: the stages' P2P buffers have fixed shapes
        self.ran: set[int] = set()            # lengths whose schedule has set itself up

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def params(self) -> list[nn.Parameter]:
        return [p for s in self.stages for p in s.parameters()]

    # ---- training ---------------------------------------------------------------------------
    def _schedule(self, rows: int, length: int) -> Any:
        """The schedule for micro-batches of (rows, length) tokens, built once per length (static shapes)."""
        if length in self.schedules:
            return self.schedules[length]
        stages = []
        for stage, index in zip(self.stages, self.indices):
            ids = torch.empty(rows, length, dtype=torch.long, device="meta")
            # requires_grad: gradients of the hidden states travel back the same way (static metadata)
            hidden = torch.empty(rows, length, self.hidden_size, dtype=self.dtype, device="meta", requires_grad=True)
            out = torch.empty(1, dtype=torch.float32, device="meta", requires_grad=True) if stage.last else hidden
            stages.append(PipelineStage(stage, index, self.num_stages, self.device, group=self.group,
                                        input_args=(ids if stage.first else hidden,), output_args=(out,)))
        cls = SCHEDULES[self.schedule_name]
        try:
            sched = cls(stages if cls is ScheduleInterleaved1F1B else stages[0], self.microbatches,
                        loss_fn=_summed, scale_grads=False)
        except ValueError as e:  # torch's words for a micro-batch count the schedule cannot split into rounds
            raise ConfigError(f"parallel.microbatches = {self.microbatches} does not fit the "
                              f"{self.schedule_name} schedule over pp = {self.pp}: {e}") from None
        self.schedules[length] = sched
        return sched

    def train_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one batch through the pipeline, gradients accumulated as SUMS over targets.

        Returns (loss sum, target count): the loss sum is this batch's on the last stage's rank, 0 elsewhere."""
        inputs, targets = split_batch(batch)
        rows, length = inputs["input_ids"].shape
        check_microbatches(self.microbatches, rows)
        sched = self._schedule(rows // self.microbatches, length)
        ids = inputs.pop("input_ids")
        # FSDP drops the parameters' gradients when a new schedule sets itself up: keep this window's so far
        kept = self._take_grads() if self.fsdp and length not in self.ran else None
        losses: list[torch.Tensor] = []
        sched.step(*((ids,) if self.has_first else ()), target=targets, losses=losses, return_outputs=False,
                   targets=targets, **inputs)
        self.ran.add(length)
        if kept is not None:
            self._give_grads(kept)
        count = (targets != IGNORE_INDEX).sum()
        loss_sum = torch.stack([l.detach().reshape(()) for l in losses]).sum() if losses else torch.zeros(())
        return loss_sum.to(torch.float64), count.to(torch.float64)

    def _take_grads(self) -> list[torch.Tensor | None]:
        params = self.params()
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        return kept

    def _give_grads(self, kept: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.params(), kept):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

    def finish_gradients(self, units: float) -> None:
        """Sum the gradients over the dp replicas of each stage, then divide by the global unit count."""
        if self.fsdp:  # FSDP reduce-scattered them already, as the mean over dp
            self._sum_tied()
            grads = [p.grad for p in self.params() if p.grad is not None]
            for g in grads:
                g.mul_(self.dp / units)
            return
        grads = [p.grad for p in self.params() if p.grad is not None]
        if self.dp > 1 and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
            dist.all_reduce(flat, group=self.mesh.get_group("dp"))
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._sum_tied()  # after dp's reduction: both copies then hold the very same bits
        grads = [p.grad for p in self.params() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / units)

    def _sum_tied(self) -> None:
        """Tied embeddings: the first stage's gradient plus the head copy's, on both ranks."""
        if self.tie_group is None:
            return
        weight = self.tied_copy if self.tied_copy is not None else self.embedding_weight
        assert weight is not None, "a tied pipeline's first or last stage holds the embedding"
        if not weight.requires_grad:  # frozen (LoRA): nothing to keep in step
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.tie_group)

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        """Clip to a global 2-norm over every stage (and FSDP shard); returns the norm before clipping."""
        grads = [p.grad for p in self.params() if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            if self.tied_copy is not None and g is self.tied_copy.grad:
                continue  # the same gradient as the first stage's embedding
            local = g.to_local() if isinstance(g, DTensor) else g
            total += torch.linalg.vector_norm(local, dtype=torch.float32).double() ** 2
        # stages hold different parameters; FSDP shards are different pieces too, plain dp replicas are copies
        group = None if self.fsdp else self.group
        dist.all_reduce(total, group=group)
        return scale_to_norm(grads, math.sqrt(float(total)), max_norm)

    # ---- forward only (eval): stage by stage, plain send/recv, any batch shape ----------------
    @torch.no_grad()
    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, target count) of one batch on every rank of the pipeline (the last stage's, broadcast)."""
        inputs, targets = split_batch(batch)
        ids = inputs.pop("input_ids")
        rows, length = ids.shape
        ranks = dist.get_process_group_ranks(self.group)
        x: torch.Tensor = ids
        loss = torch.zeros(1, dtype=torch.float32, device=self.device)
        for stage, index in zip(self.stages, self.indices):
            if index > 0:
                x = torch.empty(rows, length, self.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(x, src=ranks[(index - 1) % self.pp], group=self.group)
            x = stage(x, targets=targets, **inputs)
            if index < self.num_stages - 1:
                dist.send(x.contiguous(), dst=ranks[(index + 1) % self.pp], group=self.group)
            else:
                loss = x
        dist.broadcast(loss, src=ranks[(self.num_stages - 1) % self.pp], group=self.group)
        return loss.reshape(()).to(torch.float64), (targets != IGNORE_INDEX).sum().to(torch.float64)


def _summed(output: torch.Tensor, _targets: torch.Tensor) -> torch.Tensor:
    """The last stage already returns its micro-batch's summed loss (it holds the head and the targets)."""
    return output.sum()


def split_batch(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(model inputs, next-token targets (B, T)) of a causal-LM batch; position ids made (B, T) to split by row."""
    if "targets" in batch:
        targets = batch["targets"]
    elif "labels" in batch:
        targets = shift_labels(batch["labels"])
    else:
        raise KilnError("parallel.pp trains a causal LM: each batch needs labels or targets")
    extra = sorted(set(batch) - set(MODEL_INPUTS) - {"labels", "targets"})
    if extra:
        raise KilnError(f"parallel.pp passes only {', '.join(MODEL_INPUTS)} to the model; this batch also has "
                        f"{', '.join(extra)}")
    inputs = {k: batch[k] for k in MODEL_INPUTS if batch.get(k) is not None}
    if "position_ids" in inputs:
        inputs["position_ids"] = inputs["position_ids"].expand_as(inputs["input_ids"])
    return inputs, targets


def _eval_forward(pipe: Pipeline):
    """The pipelined model's own forward: loss sum and count of a batch, for evaluation (all pp ranks call it)."""
    def forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, targets=None,
                **ignored: Any) -> CausalLMOutput:
        if torch.is_grad_enabled():
            raise KilnError("a pipeline-parallel model trains through its schedule (the Trainer's pp step); call "
                            "it directly only under torch.no_grad(), for evaluation")
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 "labels": labels, "targets": targets}
        loss_sum, count = pipe.forward_loss({k: v for k, v in batch.items() if v is not None})
        return CausalLMOutput(loss=loss_sum / count if labels is not None else None, loss_sum=loss_sum,
                              loss_count=count)
    return forward


def check_pipeline(model: nn.Module, parallel: Any) -> list[int]:
    """Refuse a model or [parallel] table pp cannot run (before any process group work); blocks per stage."""
    backbone, blocks_attr, _, _ = _parts(model)
    blocks = getattr(backbone, blocks_attr)
    num_blocks = int(getattr(backbone, "num_main_layers", len(blocks)))
    sizes = stage_sizes(num_blocks, parallel.pp, parallel.pp_schedule, parallel.pp_stages, model_name(model))
    start = 0
    for i, n in enumerate(sizes):
        # only hidden states cross a boundary: a layer reusing its predecessor's sparse-attention keys cannot open one
        if getattr(getattr(blocks[start], "self_attn", None), "sparse", None) == "shared":
            raise ConfigError(f"parallel.pp: stage {i} would start at layer {start} of {model_name(model)}, which "
                              f"reuses the previous layer's sparse-attention choice (indexer_types 'shared'); give "
                              f"parallel.pp_stages so that every stage starts at a layer with its own indexer")
        start += n
    return sizes


def check_microbatches(microbatches: int, rows: int) -> None:
    if rows % microbatches:
        raise ConfigError(f"parallel.microbatches = {microbatches} does not divide the batch of {rows} rows "
                          f"(train.batch_size); choose a batch size that is a multiple of it")


def _tie_group(mesh: DeviceMesh) -> Any:
    """The group of the first and the last pp rank of this rank's dp group (every rank creates every group)."""
    layout = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # (pp, dp): cp, ep and tp are 1 with pp
    mine = None
    for d in range(layout.shape[1]):
        ranks = [int(layout[0, d]), int(layout[-1, d])]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine if mesh.get_local_rank("pp") in (0, layout.shape[0] - 1) else None


def apply_pipeline(model: nn.Module, parallel: Any, mesh: DeviceMesh, device: torch.device) -> Pipeline:
    """Cut `model` down to this rank's stages in place and build them; returns the Pipeline."""
    sizes = check_pipeline(model, parallel)
    backbone, blocks_attr, embed_attr, norm_attr = _parts(model)
    assert isinstance(model, PreTrainedModel), "_parts found the family's plan: a kiln model"
    all_blocks = getattr(backbone, blocks_attr)
    main_layers = hasattr(backbone, "num_main_layers")
    num_blocks = sum(sizes)
    pp = parallel.pp
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pp_rank = mesh.get_local_rank("pp")
    indices = [i for i in range(len(sizes)) if i % pp == pp_rank]
    first, last = 0 in indices, len(sizes) - 1 in indices
    tied = getattr(model, "lm_head", None) is None
    param = next(model.parameters())
    dtype = DTYPES[parallel.param_dtype] if parallel.fsdp and parallel.param_dtype else param.dtype

    stages = []
    for index in indices:
        blocks = [all_blocks[b] for b in range(starts[index], starts[index] + sizes[index])]
        view = _view(backbone, blocks_attr, blocks, embed_attr, norm_attr, index == 0, index == len(sizes) - 1,
                     main_layers)
        head_copy = getattr(backbone, embed_attr) if tied and index == len(sizes) - 1 else None
        stages.append(Stage(view, model, index == 0, index == len(sizes) - 1, dtype, head_copy))
    # the rank's own model keeps only what its stages hold, under the original names
    owned = {str(b) for i in indices for b in range(starts[i], starts[i] + sizes[i])}
    kept = nn.ModuleDict({str(b): all_blocks[b] for b in range(len(all_blocks))
                          if str(b) in owned or (b >= num_blocks and last)})  # MTP layers stay with the head
    setattr(backbone, blocks_attr, kept)
    if not first and not (last and tied):  # a tied head keeps the embedding on the last stage too
        setattr(backbone, embed_attr, None)
    if not last:
        setattr(backbone, norm_attr, None)
        cast(_CausalLM, model).lm_head = None  # cast: _parts accepted it as a causal LM

    for stage in stages:
        apply_activation_checkpointing(stage, parallel.activation_checkpointing, parallel.checkpoint_every)
        if parallel.compile:
            for block in cast(nn.ModuleList, stage.model.get_submodule(blocks_attr)):  # _view made it one
                block.compile(backend=parallel.compile_backend, fullgraph=False)
        if parallel.fsdp:
            apply_fsdp(stage, mesh["dp"], parallel.param_dtype, parallel.reduce_dtype, parallel.offload)
    microbatches = parallel.microbatches or 2 * pp
    pipe = Pipeline(stages, indices, len(sizes), parallel.pp_schedule, microbatches, mesh, bool(parallel.fsdp),
                    device, dtype, int(text_sizes(model.config).hidden_size))
    if tied:
        pipe.tie_group = _tie_group(mesh)
        embedding = getattr(backbone, embed_attr)
        if first:
            pipe.embedding_weight = embedding.weight
        elif last:
            pipe.tied_copy = embedding.weight
    model.forward = _eval_forward(pipe)  # on the instance: evaluation calls the model as ever
    return pipe
