"""Spawned ranks for the FP8-kept FSDP2, EP and TP tests: LoRA steps on a frozen FP8 base sharded over gloo, a
unit holding nothing but FP8 weights, sharded with and without `frozen_as_bytes`, steps on an FP8 MoE
whose routed experts are split over ep ranks, and steps on an FP8 release whose Linears are split over tp ranks
(a helper, not a test module)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

FP8 = torch.float8_e4m3fn
TARGETS = ["q_proj", "v_proj", "down_proj"]  # k_proj, o_proj, gate_proj, up_proj stay plain FP8Linears
STEPS, LR = 3, 0.05


def batch() -> torch.Tensor:
    """4 rows of 9 token ids, every one a label: each rank's mean loss weighs the same number of tokens."""
    return torch.randint(4, 99, (4, 9), generator=torch.Generator().manual_seed(2))


def sgd_steps(model: nn.Module, ids: torch.Tensor, world: int, sync=None) -> list[float]:
    """STEPS SGD steps of the trained parameters on `ids` (its own labels); each step's loss averaged over ranks."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if sync is not None:
            sync()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    return losses


def with_adapters(model: nn.Module) -> nn.Module:
    """LoRA (r 4) on TARGETS with random adapters (B non-zero, so every adapter gets a gradient from the first
    step); a model built on meta gets its adapters materialised first (`init_adapters`)."""
    from kiln.models.common.lora import LoraConfig, apply_lora
    from kiln.parallel.sharded_load import init_adapters

    apply_lora(model, LoraConfig(r=4, alpha=8, targets=TARGETS))
    init_adapters(model, "cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def lora_steps(rank: int, world: int, model_dir: str, out: str) -> None:
    """STEPS SGD steps of LoRA on the FP8-kept base, this rank on its rows; losses (global means) and the
    adapters after the steps go to `out`. world == 1: the one-process reference (no plans)."""
    from kiln.models.auto import load_whole
    from kiln.parallel.apply import parallelize
    from kiln.train.config import ParallelSection

    model = with_adapters(load_whole(model_dir, fp8="keep", seed=0))
    whole = {k: v.clone() for k, v in model.state_dict().items() if v.dtype == FP8}
    facts: dict = {"fp8_tensors": len(whole)}
    if world > 1:
        parallelize(model, ParallelSection(fsdp=True), world_size=world, device=torch.device("cpu"))
        q = model.model.layers[0].self_attn.q_proj
        facts["at_rest"] = str(q._parameters["weight"].dtype)  # the bytes FSDP holds and gathers
        seen = []
        q.register_forward_hook(lambda m, a, o: seen.append(str(m.weight.dtype)))
        state = model.state_dict()
        facts["state_dict_mismatch"] = [k for k, v in whole.items() if state[k].dtype != FP8 or not torch.equal(
            state[k].to_local().view(torch.uint8), v.view(torch.uint8).chunk(world)[rank])]
    losses = sgd_steps(model, batch().chunk(world)[rank], world)
    if world > 1:
        facts["seen_in_forward"] = sorted(set(seen))
    adapters = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
                for n, p in model.named_parameters() if ".lora_" in n}
    if rank == 0:
        save_file(adapters, os.path.join(out, f"adapters-{world}.safetensors"))
        with open(os.path.join(out, f"facts-{world}.json"), "w") as f:
            json.dump({"losses": losses, **facts}, f)


class _Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _fp8_stack(block: tuple[int, int] = (16, 16)) -> _Stack:
    """Two frozen FP8Linears and nothing else: each is an FSDP unit that all-gathers float8 only."""
    from kiln.hub.fp8 import quantize
    from kiln.models.common.fp8 import FP8Linear

    g = torch.Generator().manual_seed(3)
    layers = []
    for n_in, n_out in ((32, 48), (48, 16)):
        q, s = quantize(torch.randn(n_out, n_in, generator=g), block, False, torch.float32)
        layer = FP8Linear(n_in, n_out, False, block)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale_inv = s
        layers.append(layer)
    return _Stack(layers)


def only_fp8_unit(rank: int, world: int, out: str) -> None:
    """The same FP8-only unit sharded as is (gloo refuses float8) and through `apply_fsdp` (bytes); the
    latter's output equals the unsharded one's, and its forward sees FP8 even with param_dtype bf16 (a
    policy that would otherwise widen the weights to bf16 before gathering them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from kiln.parallel.fsdp import apply_fsdp

    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    ref = _fp8_stack()(x)
    raw = _fp8_stack()
    for layer in raw.layers:
        fully_shard(layer)
    fully_shard(raw)
    try:
        raw(x)
        raw_error = ""
    except RuntimeError as e:
        raw_error = str(e).splitlines()[0]
    mesh = init_device_mesh("cpu", (world,))
    results = {"raw_error": raw_error}
    for param_dtype in (None, "bf16"):
        model = apply_fsdp(_fp8_stack(), mesh, param_dtype)
        seen = []
        model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))
        y = model(x)
        # bf16: FSDP casts the input; one process given the bf16 input computes the very same
        want = ref if param_dtype is None else _fp8_stack()(x.bfloat16())
        results[str(param_dtype)] = {"equal": y.dtype == want.dtype and torch.equal(y, want), "seen": seen}
    with open(os.path.join(out, f"only-fp8-rank{rank}.json"), "w") as f:
        json.dump(results, f)


EP_PLANS = {"ep": dict(ep=2), "ep-fsdp": dict(ep=2, fsdp=True)}


def ep_steps(rank: int, world: int, model_dir: str, out: str) -> None:
    """STEPS SGD steps on an FP8 MoE kept FP8 (routed experts frozen FP8, the rest trained): world == 1 loads it
    whole and runs it as is; over 2 ranks, each plan of EP_PLANS in turn builds it on meta, applies the plan and
    reads this rank's share (its experts' FP8 bytes and scale grids only), each rank on its half of the batch.
    The global mean losses and what each rank holds of the experts go to `out`, with the model after the steps
    (saved by one process, a sharded checkpoint by the ranks)."""
    from kiln.models.auto import load_whole
    from kiln.parallel.apply import parallelize
    from kiln.parallel.checkpoint import save_sharded
    from kiln.parallel.ep import expert_modules
    from kiln.parallel.sharded_load import empty_pretrained, read_shards
    from kiln.train.config import ParallelSection

    for name, plan in EP_PLANS.items() if world > 1 else [("one", None)]:
        facts: dict = {}
        if plan is None:
            model, par = load_whole(model_dir, fp8="keep"), None
        else:
            model = empty_pretrained(model_dir, fp8="keep")
            par = parallelize(model, ParallelSection(**plan), world_size=world, device=torch.device("cpu"))
            read_shards(model, model_dir)
            experts = expert_modules(model)
            stored = [(t.to_local() if isinstance(t, DTensor) else t) for m in experts
                      for t in (*m._parameters.values(), *m._buffers.values())]
            facts["held"] = [[str(t.dtype), t.shape[0]] for t in stored]
            facts["num_experts"] = experts[0].num_experts
        losses = sgd_steps(model, batch().chunk(world)[rank if par is None else par.data_rank], world,
                           None if par is None else par.sync_gradients)
        if plan is None:
            model.save_pretrained(os.path.join(out, "ep-one-model"))
        else:  # a sharded checkpoint, each rank its experts (FP8 as stored), for `export_sharded`
            save_sharded(os.path.join(out, f"ep-{name}-ckpt"), model)
        with open(os.path.join(out, f"ep-{name}-rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, **facts}, f)


# an FP8 release whose every split is whole 128 x 128 blocks at tp = 2: q/k/v/o and the MLP 256 wide
TP_SIZE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
               num_hidden_layers=2)
# world size -> plans (tp x fsdp on 4 ranks, dict(tp=2, fsdp=True), equals one process too, measured at ~5 s: its
# reads are checked byte for byte in tests/parallel/test_sharded_load.py instead)
TP_PLANS = {2: {"tp": dict(tp=2), "tp-lora": dict(tp=2)}}


def tp_release(tiny_factory, root):
    """A tiny Qwen3 of TP_SIZE (transformers' random weights) written as an FP8 release in 128 x 128 blocks."""
    from tests.models.fp8_cases import make_fp8

    return make_fp8(tiny_factory("qwen3", "causal-lm", **TP_SIZE), root / "fp8", "Qwen3ForCausalLM", block=(128, 128))


def tp_steps(rank: int, world: int, model_dir: str, out: str) -> None:
    """STEPS SGD steps on an FP8 release kept FP8 (its Linears frozen FP8, the rest trained): world == 1 loads it
    whole and runs it as is; else each plan of TP_PLANS[world] builds it on meta, applies the plan and reads this
    rank's FP8 rows or columns and their scale blocks (through a host stage, which notes every piece it read),
    each data rank on its share of the batch. The global mean losses and what this rank holds of each FP8 Linear
    go to `out`."""
    from kiln.models.auto import load_whole
    from kiln.models.loading.stage import HostStage
    from kiln.parallel.apply import parallelize
    from kiln.parallel.sharded_load import empty_pretrained, read_shards
    from kiln.parallel.tp import tensor_plan
    from kiln.parallel.tp_fp8 import fp8_splits
    from kiln.train.config import ParallelSection

    class Noting(HostStage):
        def note(self, nbytes: int) -> None:
            super().note(nbytes)
            self.pieces.append(nbytes)

    for name, plan in TP_PLANS[world].items() if world > 1 else [("one", None), ("one-lora", None)]:
        facts: dict = {}
        lora = name.endswith("-lora")  # LoRA on q_proj, v_proj (column parallel), down_proj (row parallel)
        if plan is None:
            model, par = load_whole(model_dir, task="causal-lm", fp8="keep"), None
            model = with_adapters(model) if lora else model
            ids = batch()
        else:
            model = empty_pretrained(model_dir, task="causal-lm", fp8="keep")
            model = with_adapters(model) if lora else model
            splits = [(path, dim) for path, _, dim in fp8_splits(model, tensor_plan(model, 2))]
            par = parallelize(model, ParallelSection(**plan), world_size=world, device=torch.device("cpu"))
            stage = Noting()
            stage.pieces = []
            read_shards(model, model_dir, stage=stage)
            facts["pieces"] = stage.pieces
            held = {}
            for path, dim in splits:
                m = model.get_submodule(path)
                w, s = m._parameters["weight"], m._buffers["weight_scale_inv"]
                held[path] = {"dim": dim, "global": list(w.shape), "weight": [str(w.dtype), list(w.to_local().shape)],
                              "scale": [str(s.dtype), list(s.to_local().shape)], "block": list(m.block)}
            facts["held"] = held
            facts["largest_piece"] = max((t.to_local() if isinstance(t, DTensor) else t).nbytes
                                         for t in (*model.parameters(), *model.buffers()))
            dp = world // 2
            ids = batch().chunk(dp)[par.data_rank]
        losses = sgd_steps(model, ids, world, None if par is None else par.sync_gradients)
        if name == "tp":  # a run's sharded checkpoint: each rank its FP8 pieces and scale blocks, as stored
            from kiln.parallel.checkpoint import save_sharded

            save_sharded(os.path.join(out, "tp-ckpt"), model)
        with open(os.path.join(out, f"tp-{name}-rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, **facts}, f)


def biased_pair(rank: int, world: int, out: str) -> None:
    """A column-parallel then a row-parallel FP8Linear, both with a bias (Qwen2's q/k/v have one; the row-parallel
    bias is added once to the sum of the partial outputs): output and gradients of x and of both biases vs one
    process, to `out`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from kiln.hub.fp8 import quantize
    from kiln.models.common.fp8 import FP8Linear
    from kiln.parallel.tp_fp8 import _split_bytes

    g = torch.Generator().manual_seed(5)

    def linear(n_in: int, n_out: int) -> FP8Linear:
        q, s = quantize(torch.randn(n_out, n_in, generator=g), (16, 16))
        m = FP8Linear(n_in, n_out, True, (16, 16))
        m.weight, m.weight_scale_inv = nn.Parameter(q, requires_grad=False), s
        with torch.no_grad():
            m.bias.copy_(torch.randn(n_out, generator=g))
        return m

    pair = nn.Sequential(linear(32, 64), linear(64, 32))
    x = torch.randn(3, 5, 32, generator=g, requires_grad=True)
    pair(x).square().sum().backward()
    want = [pair(x).detach(), x.grad.clone(), pair[0].bias.grad.clone(), pair[1].bias.grad.clone()]
    x.grad = pair[0].bias.grad = pair[1].bias.grad = None
    mesh = init_device_mesh("cpu", (world,))
    for m, dim in ((pair[0], 0), (pair[1], 1)):  # as kiln.parallel.tp_fp8.split_fp8_linears splits them
        m.weight = nn.Parameter(_split_bytes(m.weight.data, mesh, dim), requires_grad=False)
        m.weight_scale_inv = _split_bytes(m.weight_scale_inv, mesh, dim)
    parallelize_module(pair, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    y = pair(x)
    y.square().sum().backward()
    got = [y.detach(), x.grad, pair[0].bias.grad.full_tensor(), pair[1].bias.grad.full_tensor()]
    scale = [w.abs().max().item() for w in want]
    with open(os.path.join(out, f"biased-rank{rank}.json"), "w") as f:
        json.dump({"diff": [(a - b).abs().max().item() for a, b in zip(got, want)], "scale": scale}, f)


def tp_runs(rank: int, world: int, model_dir: str, out: str) -> None:
    """`tp_steps`, and over 2 ranks `biased_pair` too (one spawn: starting the ranks costs more than the work)."""
    tp_steps(rank, world, model_dir, out)
    if world == 2:
        biased_pair(rank, world, out)


def dequantized_checkpoint(rank: int, world: int, model_dir: str, out: str) -> None:
    """The default (`fp8 = "dequantize"`) sharded load of an FP8 release under FSDP2 (each rank reads and
    dequantizes its rows: kiln.parallel.sharded_fp8), one SGD step of the whole model, then a sharded
    checkpoint in OUT/deq-ckpt."""
    from kiln.parallel.apply import parallelize
    from kiln.parallel.checkpoint import save_sharded
    from kiln.parallel.sharded_load import lean_pretrained, read_shards
    from kiln.train.config import ParallelSection

    model = lean_pretrained(model_dir, "causal-lm", 0)
    assert model is not None and model.fp8_state.mode == "dequantize" and not model.fp8_state.originals
    parallelize(model, ParallelSection(fsdp=True), world_size=world, device=torch.device("cpu"))
    read_shards(model, model.deferred_read.index, "cpu")
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    save_sharded(os.path.join(out, "deq-ckpt"), model)


V4_LOADS = ("lean", "whole")  # read shard by shard after the plans; loaded whole, then sharded


def v4_keep_checkpoints(rank: int, world: int, model_dir: str, out: str) -> None:
    """DeepSeek-V4's release kept FP8 under FSDP2, for each of V4_LOADS: layer 0's `wo_a` (dequantized at load, no
    FP8 module holds it) and the float32 parameters frozen, one SGD step of every other trained parameter on this
    rank's half of the batch, then a sharded checkpoint in OUT/v4-<load>."""
    from kiln.models.auto import load_whole
    from kiln.parallel.apply import parallelize
    from kiln.parallel.checkpoint import save_sharded
    from kiln.parallel.sharded_load import lean_pretrained, read_shards
    from kiln.train.config import ParallelSection

    for how in V4_LOADS:
        model = lean_pretrained(model_dir, "causal-lm", 0, fp8="keep") if how == "lean" else \
            load_whole(model_dir, task="causal-lm", fp8="keep", seed=0)
        assert (getattr(model, "deferred_read", None) is not None) == (how == "lean")
        for p in model.parameters():  # FSDP2 trains one dtype per unit: V4's float32 ones (hyper connections,
            p.requires_grad_(p.requires_grad and p.dtype != torch.float32)  # sinks, norms) stay as read
        model.model.layers[0].self_attn.o_a_proj.weight.requires_grad_(False)
        parallelize(model, ParallelSection(fsdp=True), world_size=world, device=torch.device("cpu"))
        if how == "lean":
            read_shards(model, model.deferred_read.index, "cpu")
        ids = batch().chunk(world)[rank]
        model(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        save_sharded(os.path.join(out, f"v4-{how}"), model)


def keep_and_dequantized_checkpoints(rank: int, world: int, fp8_dir: str, v4_dir: str, out: str) -> None:
    """`dequantized_checkpoint` of FP8_DIR and `v4_keep_checkpoints` of V4_DIR in one spawn (starting the ranks costs
    more than the work)."""
    dequantized_checkpoint(rank, world, fp8_dir, out)
    v4_keep_checkpoints(rank, world, v4_dir, out)
