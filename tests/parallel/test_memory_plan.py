"""kiln plan: header reading, the memory terms by hand, the sharding divisions, the activation formula
against autograd's own count of saved tensors, and the CLI's messages."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from kiln.errors import ConfigError, WeightsError
from kiln.hub.headers import TensorHeader, read_headers
from kiln.parallel.memory import (
    ModelDims,
    RunSettings,
    alternatives,
    block_activation_bytes,
    check_shapes,
    params_from_headers,
    parse_size,
    plan_memory,
)

# A tiny Qwen3-shaped model: hidden 8, 2 layers, 2 heads of 4 over 1 kv head, MLP 12, vocab 16, untied head.
CONFIG = dict(model_type="qwen3", hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=4, intermediate_size=12, vocab_size=16, tie_word_embeddings=False,
              max_position_embeddings=64, rms_norm_eps=1e-6, torch_dtype="float32")


def tiny_shapes(layers: int = 2) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,), "lm_head.weight": (16, 8)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (8,), p + "post_attention_layernorm.weight": (8,),
                       p + "self_attn.q_proj.weight": (8, 8), p + "self_attn.k_proj.weight": (4, 8),
                       p + "self_attn.v_proj.weight": (4, 8), p + "self_attn.o_proj.weight": (8, 8),
                       p + "self_attn.q_norm.weight": (4,), p + "self_attn.k_norm.weight": (4,),
                       p + "mlp.gate_proj.weight": (12, 8), p + "mlp.up_proj.weight": (12, 8),
                       p + "mlp.down_proj.weight": (8, 12)})
    return shapes


def headers(dtype: str = "F32") -> dict[str, TensorHeader]:
    return {k: TensorHeader(k, v, dtype, "model.safetensors") for k, v in tiny_shapes().items()}


# Hand counts for the tiny model: per layer 64 + 32 + 32 + 64 (attention) + 4 + 4 (q/k norms) + 3 * 96 (MLP)
# + 8 + 8 (norms) = 504 elements; outside the layers 128 (embedding) + 8 (norm) + 128 (head) = 264.
N_LAYER, N_OUTSIDE, N_TENSORS = 504, 264, 3 + 2 * 11
N_ALL = 2 * N_LAYER + N_OUTSIDE  # 1272
DIMS = check_shapes(headers(), ModelDims.from_config(CONFIG))


def plan(settings: RunSettings, dtype: str = "F32", **kw):
    params = params_from_headers(headers(dtype).values(), settings)
    return plan_memory(params, DIMS, settings, {"model.safetensors": N_ALL * 4 + 1000}, runtime=0, **kw)


def test_full_finetune_weights_grads_optimizer_exact():
    p = plan(RunSettings(batch_size=2, seq_len=8)).ranks[0].terms
    assert p["weights"] == N_ALL * 4 == 5088
    assert p["gradients"] == N_ALL * 4
    assert p["optimizer"] == 2 * N_ALL * 4 + 4 * N_TENSORS  # two fp32 moments, one 4-byte step per tensor
    assert p["communication"] == 0 and p["autocast"] == 0
    bf16 = plan(RunSettings(batch_size=2, seq_len=8), dtype="BF16").ranks[0].terms
    assert bf16["weights"] == N_ALL * 2 and bf16["optimizer"] == 2 * N_ALL * 2 + 4 * N_TENSORS  # moments in bf16


def test_activations_from_the_formula():
    # fp32, full: per token and block 8 (two rstd) + 2 heads * 8 + 1 kv head * 4 + q 8 * (8 + 8) + k/v 4 * (8 + 4)
    # + 4 * 4 + norms 8 * 2 * (4 + 8) + MLP 4 * 4 * 12 = 8 + 16 + 4 + 128 + 64 + 192 + 192 = 604 bytes
    assert block_activation_bytes(DIMS, 4, True, set(), 0) == 604
    tokens = 2 * 8
    outside = tokens * 16 + tokens * 8 * (4 + 8) + 4 * 16 * 8 + tokens * 16 * 4  # ids; norm; head dW; fp32 logits
    assert plan(RunSettings(batch_size=2, seq_len=8)).ranks[0].terms["activations"] == 2 * 604 * tokens + outside
    # bf16 weights: each chunk's logits in bf16 and fp32 and their bf16 gradient; the head's product in bf16 + fp32
    bf = plan(RunSettings(batch_size=2, seq_len=8), dtype="BF16").ranks[0].terms
    outside_bf = tokens * 16 + tokens * 8 * (4 + 4) + 4 * 16 * 8 + tokens * 16 * (4 + 4) + 16 * 8 * (2 + 4)
    assert bf["activations"] == 2 * block_activation_bytes(DIMS, 2, True, set(), 0) * tokens + outside_bf
    # block checkpointing keeps each block's input (8 fp32 values per token) and recomputes one block
    ac = plan(RunSettings(batch_size=2, seq_len=8, activation_checkpointing="block")).ranks[0].terms
    assert ac["activations"] == 2 * tokens * 8 * 4 + 604 * tokens + outside


def test_lora_adapters_and_frozen_base():
    s = RunSettings(batch_size=2, seq_len=8, lora_r=2, lora_targets=("q_proj", "v_proj"))
    p = plan(s).ranks[0].terms
    adapters = 2 * (2 * (8 + 8) + 2 * (8 + 4))  # per layer A (r, in) + B (out, r) for q (8x8) and v (4x8)
    assert p["weights"] == (N_ALL + adapters) * 4
    assert p["gradients"] == adapters * 4
    assert p["optimizer"] == 2 * adapters * 4 + 4 * 8  # 8 adapter tensors
    everything = RunSettings(lora_r=2, lora_targets="all-linear")
    names = [q.name for q in params_from_headers(headers().values(), everything) if q.trainable]
    assert len(names) == 2 * 7 * 2 and not any("lm_head" in n or "embed" in n for n in names)


def test_fp8_checkpoint_dequantized_or_kept():
    fp8 = {k: TensorHeader(k, t.shape, "F8_E4M3" if t.name.endswith("proj.weight") else "BF16", t.file)
           for k, t in headers().items()}
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    fp8[scale] = TensorHeader(scale, (1, 1), "F32", "model.safetensors")
    deq = params_from_headers(fp8.values(), RunSettings())
    assert scale not in {q.name for q in deq} and sum(q.nbytes for q in deq) == N_ALL * 2
    kept = params_from_headers(fp8.values(), RunSettings(fp8="keep", lora_r=2))
    linears = 2 * (64 + 32 + 32 + 64 + 3 * 96)
    assert sum(q.nbytes for q in kept if not q.trainable) == linears + (N_ALL - linears) * 2 + 4
    assert {q.itemsize for q in kept if q.trainable} == {2}  # the adapters in the compute dtype


@pytest.mark.parametrize("nproc, kw, weights", [
    (4, dict(fsdp=True), N_ALL * 4 / 4),
    # tp=2 halves the Linears, the embedding and the head; norms (2 * (8 + 8 + 4 + 4) + 8 = 56) stay whole
    (2, dict(tp=2), (N_ALL - 56) * 4 / 2 + 56 * 4),
    (4, dict(tp=2, fsdp=True), ((N_ALL - 56) / 2 + 56) * 4 / 2),
])
def test_sharding_divisions(nproc, kw, weights):
    p = plan(RunSettings(nproc=nproc, batch_size=2, seq_len=8, **kw)).ranks[0].terms
    assert p["weights"] == round(weights)
    assert p["gradients"] == round(weights)


def test_fsdp_buffers():
    # a block gathered and one prefetched (504 fp32 values each), the root gathered (264), and one block's
    # unsharded gradients with their fp32 reduce copy (504 * (4 + 4))
    p = plan(RunSettings(nproc=2, fsdp=True, batch_size=2, seq_len=8)).ranks[0].terms
    assert p["communication"] == 2 * 504 * 4 + 264 * 4 + 504 * 8
    bf = plan(RunSettings(nproc=2, fsdp=True, batch_size=2, seq_len=8, param_dtype="bf16", reduce_dtype="bf16")
              ).ranks[0].terms
    assert bf["communication"] == 2 * 504 * 2 + 264 * 2 + 504 * (4 + 2)
    # the unit's unsharded gradients exist in the backward, beside the gradients, not the activations
    r = plan(RunSettings(nproc=2, fsdp=True, batch_size=2, seq_len=8)).ranks[0]
    t = r.terms
    assert r.backward_comm == 504 * 8
    assert r.total == sum(t.values()) - min(t["activations"], t["gradients"] + 504 * 8)


def test_pipeline_stages_hold_their_blocks():
    stages = plan(RunSettings(nproc=2, pp=2, batch_size=4, seq_len=8)).ranks
    assert [r.terms["weights"] for r in stages] == [(128 + N_LAYER) * 4, (N_LAYER + 8 + 128) * 4]
    # tied: no lm_head in the checkpoint; the last stage keeps a copy of the embedding for its head
    tied = [h for k, h in headers().items() if k != "lm_head.weight"]
    s = RunSettings(nproc=2, pp=2, batch_size=4, seq_len=8)
    stages = plan_memory(params_from_headers(tied, s), DIMS, s, {}, runtime=0).ranks
    assert [r.terms["weights"] for r in stages] == [(128 + N_LAYER) * 4, (N_LAYER + 8 + 128) * 4]


def test_expert_parallel_splits_experts():
    moe = dict(headers())
    for e in range(4):
        for name, shape in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))):
            k = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            moe[k] = TensorHeader(k, shape, "F32", "model.safetensors")
    dims = replace(DIMS, experts=4, top_k=2, moe_intermediate=6)
    expert_bytes = 4 * 3 * 48 * 4
    one = plan_memory(params_from_headers(moe.values(), RunSettings()), dims, RunSettings(), {}, runtime=0)
    ep2 = RunSettings(nproc=2, ep=2)
    two = plan_memory(params_from_headers(moe.values(), ep2), dims, ep2, {}, runtime=0)
    assert one.ranks[0].terms["weights"] - two.ranks[0].terms["weights"] == expert_bytes / 2


def test_total_counts_the_larger_of_gradients_and_activations():
    r = plan(RunSettings(batch_size=2, seq_len=8)).ranks[0]
    t = r.terms
    assert r.total == sum(t.values()) - min(t["gradients"], t["activations"])
    # glibc's share of the blocks' activations (2 layers of 16 tokens, fp32, full); the loss path's are mapped
    blocks = DIMS.layers * 16 * block_activation_bytes(DIMS, 4, True, set(), 0)
    assert t["allocator"] == round(0.35 * blocks) and t["activations"] > blocks and t["runtime"] == 0
    kept = plan(RunSettings(batch_size=2, seq_len=8, keep_grads=True)).ranks[0]  # cadence: zeroed, kept
    assert kept.total == sum(kept.terms.values())
    gpu = plan(RunSettings(batch_size=2, seq_len=8, device="cuda")).ranks[0].terms
    assert gpu["allocator"] == 0  # the caching allocator's reserve is not modelled; glibc's heap is


def test_ddp_buckets_and_autocast_copy():
    ddp = plan(RunSettings(nproc=2, batch_size=2, seq_len=8)).ranks[0].terms
    assert ddp["communication"] == N_ALL * 4  # a flat copy of every gradient
    bf = plan(RunSettings(batch_size=2, seq_len=8, precision="bf16")).ranks[0].terms
    assert bf["autocast"] == 2 * 2 * (64 + 32 + 32 + 64 + 3 * 96)  # bf16 copies of the block Linears


def test_todays_loader_reads_everything_on_every_rank():
    s = RunSettings(nproc=4, fsdp=True, batch_size=1, seq_len=1)
    params = params_from_headers(headers().values(), s)
    files = {"a.safetensors": 3000, "b.safetensors": 2088}
    design = plan_memory(params, DIMS, s, files, runtime=0).ranks[0]
    today = plan_memory(params, DIMS, s, files, today=True, runtime=0).ranks[0]
    train = design.total - design.terms["load"]
    # read peak: a's 3000 bytes copied + b's 2088 mapped and copied; sharding: the whole model + a quarter of its
    # largest tensor (16 x 8 fp32 / 4)
    assert today.total == max(train, 3000 + 2 * 2088, N_ALL * 4 + 16 * 8)
    # the sharded read puts FSDP's rows straight from the file into the shards: it peaks at the shards alone
    assert today.load_peak == 3000 + 2 * 2088 and design.load_peak == N_ALL
    # tp's column slices pass through one whole tensor's pages: the largest tp-split one (embedding / head, fp32)
    tp = RunSettings(nproc=2, tp=2, batch_size=1, seq_len=1)
    split = plan_memory(params_from_headers(headers().values(), tp), DIMS, tp, files, runtime=0).ranks[0]
    assert split.load_peak == split.terms["weights"] + 16 * 8 * 4


def test_a_gpu_run_holds_one_staged_piece_in_host_memory_while_loading():
    from kiln.parallel.memory import HOST_STAGE, RUNTIME_CPU

    files = {"a.safetensors": 3000, "b.safetensors": 2088}
    s = RunSettings(nproc=1, device="cuda", batch_size=1, seq_len=1)
    params = params_from_headers(headers().values(), s)
    design = plan_memory(params, DIMS, s, files).ranks[0]
    today = plan_memory(params, DIMS, s, files, today=True).ranks[0]
    largest = max(p.nbytes for p in params)  # under the 64 MiB stage: the largest tensor is the largest piece
    assert largest < HOST_STAGE and design.host_load == RUNTIME_CPU + largest
    assert today.host_load == RUNTIME_CPU + 3000 + 2 * 2088  # the whole checkpoint read into host memory first
    cpu = RunSettings(nproc=1, batch_size=1, seq_len=1)
    assert plan_memory(params_from_headers(headers().values(), cpu), DIMS, cpu, files).ranks[0].host_load == 0


def test_block_formula_matches_autograd_saved_tensors():
    """block_activation_bytes against the bytes autograd really saves in one of kiln's Qwen3 blocks (a middle
    one: the difference of a 3- and a 2-layer model), full and LoRA, fp32 and bf16: equal to the byte."""
    from kiln.models.auto import AutoConfig, from_config
    from kiln.models.common.fast import set_fast
    from kiln.models.common.lora import LoraConfig, apply_lora

    def saved(layers: int, dtype: torch.dtype, lora: bool) -> int:
        cfg = AutoConfig.for_model("qwen3", vocab_size=40, hidden_size=24, intermediate_size=40,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, max_position_embeddings=64)
        model = from_config(cfg, task="causal-lm", seed=0).to(dtype)
        if lora:
            apply_lora(model, LoraConfig(4, 8, 0.0, ["q_proj", "v_proj"]))
        set_fast(model, True)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(seen.values())

    dims = ModelDims(hidden=24, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=40, vocab=40, qk_norm=True)
    for dtype, cb in ((torch.float32, 4), (torch.bfloat16, 2)):
        for lora in (False, True):
            per_block = (saved(3, dtype, lora) - saved(2, dtype, lora)) / 32
            want = block_activation_bytes(dims, cb, not lora, {"q_proj", "v_proj"} if lora else set(), 4)
            assert per_block == want, (dtype, lora)


def test_alternatives_that_fit():
    s = RunSettings(nproc=4, batch_size=2, seq_len=8)
    params = params_from_headers(headers().values(), s)
    base = plan_memory(params, DIMS, s, {}, runtime=0).peak.total
    fits = alternatives(params, DIMS, s, {}, limit=base - 1, runtime=0)
    assert fits and all(p.peak.total < base for p in fits)
    assert any(p.settings.fsdp for p in fits)
    assert alternatives(params, DIMS, s, {}, limit=1000, runtime=0) == []  # control: nothing fits 1000 bytes
    # a family without a tensor-parallel plan (kiln.parallel.tp refuses tp > 1 for it) is offered no tp
    dims = replace(DIMS, heads=4, kv_heads=4)  # heads tp = 2 and 4 divide
    every = alternatives(params, dims, s, {}, limit=2 ** 62, runtime=0)
    no_tp = alternatives(params, dims, s, {}, limit=2 ** 62, runtime=0, tensor_parallel=False)
    assert any(p.settings.tp > 1 for p in every) and no_tp and all(p.settings.tp == 1 for p in no_tp)


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2 ** 30 and parse_size("80GB") == 80 * 10 ** 9
    assert parse_size("512MiB") == 2 ** 29
    with pytest.raises(ConfigError, match="--gpu-memory 'lots'"):
        parse_size("lots")


# ---- files and the CLI ------------------------------------------------------------------------------
def write_checkpoint(d: Path, shards: int = 2, bad: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    shapes = {**tiny_shapes(), **(bad or {})}
    names = sorted(shapes)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: torch.zeros(shapes[k], dtype=torch.bfloat16) for k in part}, str(d / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def write_run(d: Path, model: Path, extra: str = "") -> Path:
    (d / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = d / "run.toml"
    cfg.write_text(f'[model]\npath = "{model}"\ntask = "causal-lm"\n[data]\ntrain = "train.jsonl"\n'
                   f'max_length = 8\n[train]\nsteps = 1\nbatch_size = 2\n{extra}')
    return cfg


def test_headers_only(tmp_path):
    model = write_checkpoint(tmp_path / "m")
    tensors, sizes = read_headers(model)
    assert {k: t.shape for k, t in tensors.items()} == tiny_shapes()
    assert {t.dtype for t in tensors.values()} == {"BF16"} and len(sizes) == 2
    assert sum(sizes.values()) > sum(t.nbytes for t in tensors.values())  # headers on top of the data
    torn = model / "model-00001-of-00002.safetensors"
    torn.write_bytes((10 ** 9).to_bytes(8, "little") + b"{}")  # a header length past the end of the file
    with pytest.raises(WeightsError, match=r"model-00001-of-00002.safetensors: not a readable safetensors file "
                                           r"\(header length 1000000000"):
        read_headers(model)


def test_headers_of_bin_weights_are_read_from_their_pickle(tmp_path):
    """PyTorch .bin shards and their index: the same names, shapes and dtypes as the safetensors they came from
    (no tensor data read), and `kiln plan` plans them."""
    from kiln.cli.main import app
    from tests.parallel.sharded_load_workers import bin_release

    model = write_checkpoint(tmp_path / "m")
    pickled = bin_release(model, tmp_path / "bin", max_shard_bytes=500)
    assert len(list(pickled.glob("pytorch_model-*.bin"))) > 1
    (a, _), (b, sizes) = read_headers(model), read_headers(pickled)
    assert {k: (t.shape, t.dtype) for k, t in a.items()} == {k: (t.shape, t.dtype) for k, t in b.items()}
    assert {t.file for t in b.values()} == set(sizes) and all(f.endswith(".bin") for f in sizes)
    r = CliRunner().invoke(app, ["plan", "--config", str(write_run(tmp_path, pickled)), "--nproc", "2"])
    assert r.exit_code == 0 and "weights" in r.output, r.output


def test_cli_table_and_no_fit(tmp_path):
    from kiln.cli.main import app

    cfg = write_run(tmp_path, write_checkpoint(tmp_path / "m"))
    ok = CliRunner().invoke(app, ["plan", "--config", str(cfg), "--nproc", "2", "--gpu-memory", "80GiB"])
    assert ok.exit_code == 0, ok.output
    assert "weights" in ok.output and "optimizer" in ok.output and "fits" in ok.output
    assert "host memory while loading" in ok.output  # a GPU run: what the host holds while the weights go over
    r = CliRunner().invoke(app, ["plan", "--config", str(cfg), "--nproc", "2", "--gpu-memory", "100KiB"])
    assert r.exit_code == 1
    assert "largest term is runtime" in r.output and "does NOT fit" in r.output


def test_cli_missing_shard_and_bad_shape(tmp_path):
    from kiln.cli.main import app

    model = write_checkpoint(tmp_path / "m")
    (model / "model-00002-of-00002.safetensors").unlink()
    r = CliRunner().invoke(app, ["plan", "--config", str(write_run(tmp_path, model))])
    assert r.exit_code == 1 and "model-00002-of-00002.safetensors" in r.output and "not in the directory" in r.output
    bad = write_checkpoint(tmp_path / "bad", bad={"model.layers.1.mlp.up_proj.weight": (10, 8)})
    r = CliRunner().invoke(app, ["plan", "--config", str(write_run(tmp_path, bad))])
    assert r.exit_code == 1
    assert "model.layers.1.mlp.up_proj.weight has shape [10, 8]" in r.output and "intermediate_size=12" in r.output


def test_cli_module_imports_no_torch():
    code = "import sys, kiln.cli.plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_cli_keeps_deepseek_v4s_residual_whole_under_tp(tmp_path):
    """DeepSeek-V4's plan keeps the residual whole on every tp rank, so `[parallel] sequence_parallel` (on by
    default) must not shrink its activation estimate; a family that splits it (qwen3) predicts less with it."""
    from kiln.cli.main import app
    from kiln.interop.tiny import TINY
    from kiln.models.auto import AutoConfig, from_config

    def predicted(model: Path, sp: str) -> str:
        cfg = write_run(tmp_path, model, f"[parallel]\ntp = 2\nsequence_parallel = {sp}\n")
        r = CliRunner().invoke(app, ["plan", "--config", str(cfg), "--nproc", "2", "--set", "train.batch_size=64",
                                     "--set", "data.max_length=1024"])
        assert r.exit_code == 0, r.output
        return next(line for line in r.output.splitlines() if "activations" in line)

    v4 = from_config(AutoConfig.for_model("deepseek_v4", **TINY["deepseek_v4"]), task="causal-lm")
    qwen3, v4 = write_checkpoint(tmp_path / "m"), v4.save_pretrained(tmp_path / "v4")  # the plan builds its model
    assert predicted(qwen3, "true") != predicted(qwen3, "false")
    assert predicted(v4, "true") == predicted(v4, "false")


# ---- 4-bit bases (kiln.parallel.memory_q4) ----------------------------------------------------------------
def q4_plan_weights(model_dir: Path, quantize: str | None, nproc: int = 1, lora: bool = False) -> int:
    """`kiln plan`'s weights term for a 4-bit base (a bitsandbytes directory, or `quantize` at load): one rank's,
    FSDP2 over `nproc`; LoRA as tests/parallel/sharded_load_workers.compare's."""
    from kiln.cli.plan import read_q4_shapes
    from kiln.hub.config import read_config

    tensors, sizes = read_headers(model_dir)
    shapes = read_q4_shapes(model_dir, tensors)
    s = RunSettings(nproc=nproc, fsdp=nproc > 1, quantize=None if shapes else quantize, q4_compute="bf16",
                    lora_r=4 if lora else None, lora_targets=("q_proj", "v_proj", "gate_proj"))
    dims = ModelDims.from_config(read_config(model_dir))
    return plan_memory(params_from_headers(tensors.values(), s, shapes), dims, s, sizes, runtime=0
                       ).ranks[0].terms["weights"]


def test_4bit_weights_term_is_what_the_loaded_model_holds(tmp_path):
    """The plan's weights for a 4-bit base equal the bytes of the loaded model's tensors (packed weights, their
    quant state, the bf16 embedding, head and norms): quantized at load, and a bitsandbytes directory written
    from it. Odd shapes (partial blocks). The quant-state JSON's length is estimated (its offset's digits vary):
    4 bytes a weight of slack; a bf16 plan of the same model is ~3x off (control)."""
    from kiln.models.auto import load_pretrained
    from tests.parallel.sharded_load_workers import q4_checkpoints

    dirs = q4_checkpoints(tmp_path)
    held = {}
    for name, quantize in (("bf16", "nf4"), ("bnb-nf4", None), ("bnb-fp4", None)):
        model = load_pretrained(dirs[name], task="causal-lm", quantize=quantize)
        held[name] = sum(t.nbytes for t in model.state_dict().values())
        slack = 14 * 4 if quantize else 0  # 14 quantized Linears
        assert abs(q4_plan_weights(dirs[name], quantize) - held[name]) <= slack, name
    assert q4_plan_weights(dirs["bf16"], None) > 2.5 * held["bf16"]  # as if bf16: the plan before 4 bits


def test_cli_prints_the_4bit_term(tmp_path):
    from kiln.cli.main import app

    model = write_checkpoint(tmp_path / "m")
    cfg = write_run(tmp_path, model, '[lora]\nr = 2\ntargets = ["q_proj", "v_proj"]\n')
    text = cfg.read_text().replace('task = "causal-lm"', 'task = "causal-lm"\nquantize = "nf4"')
    cfg.write_text(text)
    r = CliRunner().invoke(app, ["plan", "--config", str(cfg), "--nproc", "2", "--set", "parallel.fsdp=true"])
    assert r.exit_code == 0, r.output
    assert "4-bit base (nf4 quantized at load, compute bf16): 14 Linears held 4-bit" in r.output
    assert "quant state whole on each" in r.output and "dequant" in r.output
    # control: the same run without quantize has no 4-bit line
    cfg.write_text(text.replace('quantize = "nf4"\n', ""))
    r = CliRunner().invoke(app, ["plan", "--config", str(cfg), "--nproc", "2", "--set", "parallel.fsdp=true"])
    assert r.exit_code == 0 and "4-bit base" not in r.output and "dequant" not in r.output


# ---- tensors a family carries beside the model (kiln.parallel.sharded_carried) -------------------------------
def test_an_mtp_layer_is_counted_as_the_load_holds_it(tmp_path):
    """A DeepSeek-V3 release's MTP layer (layer num_hidden_layers) is carried, not trained: a read shard by shard
    (fsdp over 2) holds it by reference, so its plan equals that of the same checkpoint without the layer; one
    process loads it whole, so its weights hold the layer's bytes and its gradients and optimizer do not. Each plan's
    weights equal the bytes the load holds; with [moe] mtp_weight the live layer's, less the shared embedding and
    head copies it drops. Latent attention's shapes are checked against v_head_dim (o_proj is heads x v_head_dim)."""
    from kiln.cli.main import app
    from kiln.cli.plan import plan_inputs
    from kiln.interop.tiny import TINY
    from kiln.models.auto import AutoConfig, from_config, load_pretrained
    from kiln.parallel.sharded_load import lean_pretrained, read_shards
    from kiln.train.config import load_run_config
    from tests.parallel.test_sharded_load import v3_with_mtp

    src = v3_with_mtp(tmp_path / "mtp")
    bare = from_config(AutoConfig.for_model("deepseek_v3", **TINY["deepseek_v3"]), task="causal-lm", seed=0)
    bare.save_pretrained(tmp_path / "bare", max_shard_bytes=60_000)
    mtp_bytes = sum(t.nbytes for t in load_pretrained(src).hf_extras.values())
    assert mtp_bytes > 0.4 * sum(t.nbytes for t in bare.state_dict().values())  # a layer of three: it shows

    def terms(model: Path, nproc: int, extra: str = "") -> dict[str, int]:
        cfg = load_run_config(write_run(tmp_path, model, f"[parallel]\nfsdp = {str(nproc > 1).lower()}\n{extra}"), [])
        params, dims, s, sizes, _ = plan_inputs(cfg, nproc, "cpu")
        return plan_memory(params, dims, s, sizes, runtime=0).ranks[0].terms

    kinds = ("weights", "gradients", "optimizer", "communication", "activations")
    sharded, without = terms(src, 2), terms(tmp_path / "bare", 2)
    assert {k: sharded[k] for k in kinds} == {k: without[k] for k in kinds}
    whole, without = terms(src, 1), terms(tmp_path / "bare", 1)
    assert whole["weights"] == without["weights"] + mtp_bytes
    assert {k: whole[k] for k in kinds[1:]} == {k: without[k] for k in kinds[1:]}
    lean = lean_pretrained(src, "causal-lm", None)
    read_shards(lean, src)
    assert sum(t.nbytes for t in lean.state_dict().values()) == without["weights"]  # the MTP layer: meta, no bytes
    live = lean_pretrained(src, "causal-lm", None)
    live.enable_mtp("test")
    read_shards(live, src)
    assert terms(src, 1, "[moe]\nmtp_weight = 0.3\n")["weights"] == sum(t.nbytes for t in live.state_dict().values())
    out = CliRunner().invoke(app, ["plan", "--config", str(write_run(tmp_path, src, "[parallel]\nfsdp = true\n")),
                                   "--nproc", "2"])
    assert out.exit_code == 0 and "carried beside the model" in out.output and "42 tensors" in out.output, out.output
    config = json.loads((tmp_path / "bare" / "config.json").read_text())
    (tmp_path / "bare" / "config.json").write_text(json.dumps({**config, "v_head_dim": 10}))
    with pytest.raises(WeightsError, match=r"o_proj.weight has shape \[32, 48\].*v_head_dim=10"):
        terms(tmp_path / "bare", 1)
