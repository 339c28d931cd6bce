"""kiln plan on the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5), checkpoints written by transformers: the attention's
q_proj emits an output gate beside the query (twice the rows), which the family declares, and a Qwen3.5 release's
MTP module (`mtp.*`) is counted as the load holds it (kiln.parallel.sharded_carried); the activation bytes of the
hybrid blocks (kiln.parallel.memory_hybrid) against autograd's own count of saved tensors."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from kiln.errors import WeightsError
from kiln.parallel.memory import ModelDims, RunSettings, block_activation_bytes, plan_memory
from kiln.parallel.memory_hybrid import HybridDims, deltanet_block_bytes
from tests.parallel.test_memory_plan import DIMS, plan, write_run


def _terms(tmp_path: Path, model: Path, nproc: int, extra: str = "") -> dict[str, int]:
    from kiln.cli.plan import plan_inputs
    from kiln.train.config import load_run_config

    cfg = load_run_config(write_run(tmp_path, model, f"[parallel]\nfsdp = {str(nproc > 1).lower()}\n{extra}"), [])
    params, dims, s, sizes, _ = plan_inputs(cfg, nproc, "cpu")
    return plan_memory(params, dims, s, sizes, runtime=0).ranks[0].terms


def _nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


@pytest.fixture(scope="module")
def qwen3_5_with_mtp(tiny_factory, tmp_path_factory) -> Path:
    """A tiny Qwen3.5 text checkpoint from transformers, with the depth-1 MTP module a release ships (`mtp.*`,
    drawn fresh by kiln and saved under the release's names)."""
    from kiln.models.auto import load_pretrained

    model = load_pretrained(tiny_factory("qwen3_5_text", "causal-lm"))
    model.enable_mtp("test", fresh=True)
    out = tmp_path_factory.mktemp("qwen3_5_mtp")
    model.save_pretrained(out, max_shard_bytes=60_000)
    return out


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_a_hybrid_plans_the_weights_its_load_holds(tiny_factory, tmp_path, monkeypatch, model_type):
    """One process: the weights term is every tensor the load holds, the gradients its parameters'; FSDP2 over 2
    (a sharded read): half of them each."""
    from kiln.models.auto import load_pretrained
    from kiln.models.qwen3_next import HybridConfig
    from kiln.parallel.sharded_load import lean_pretrained, read_shards

    src = tiny_factory(model_type, "causal-lm")
    whole = load_pretrained(src)
    held = _nbytes(whole.state_dict().values())
    assert not getattr(whole, "hf_passthrough", {})
    one = _terms(tmp_path, src, 1)
    assert one["weights"] == one["gradients"] == held
    lean = lean_pretrained(src, "causal-lm", None)
    read_shards(lean, src)
    assert 2 * _terms(tmp_path, src, 2)["weights"] == _nbytes(lean.state_dict().values()) == held
    # control: without the family's declaration the headers' q_proj disagrees with config.json
    monkeypatch.setattr(HybridConfig, "attn_output_gate", False)
    with pytest.raises(WeightsError, match=r"q_proj.weight has shape \[128, 32\] but .*implies \[64, 32\]"):
        _terms(tmp_path, src, 1)


def test_qwen3_5_s_mtp_module_is_counted_as_the_load_holds_it(qwen3_5_with_mtp, tiny_factory, tmp_path):
    """Carried (no [moe] mtp_weight): one process holds the MTP tensors whole beside the model (weights, no
    gradients); a sharded read holds them by reference (no bytes). Live (mtp_weight): parameters like any other,
    outside the blocks (FSDP2's root unit)."""
    from kiln.cli.plan import plan_inputs
    from kiln.models.auto import load_pretrained
    from kiln.parallel.sharded_load import lean_pretrained, read_shards
    from kiln.train.config import load_run_config

    src = qwen3_5_with_mtp
    whole = load_pretrained(src)
    model, mtp = _nbytes(whole.state_dict().values()), _nbytes(whole.hf_passthrough.values())
    assert mtp > 0.2 * model and all(k.startswith("mtp.") for k in whole.hf_passthrough)
    one = _terms(tmp_path, src, 1)
    assert (one["weights"], one["gradients"]) == (model + mtp, model)
    lean = lean_pretrained(src, "causal-lm", None)
    read_shards(lean, src)
    assert all(t.is_meta for t in lean.hf_passthrough.values())
    assert 2 * _terms(tmp_path, src, 2)["weights"] == _nbytes(lean.state_dict().values()) == model
    live = lean_pretrained(src, "causal-lm", None)
    live.enable_mtp("test")
    read_shards(live, src)
    trained = _terms(tmp_path, src, 1, "[moe]\nmtp_weight = 0.3\n")
    assert trained["weights"] == trained["gradients"] == _nbytes(live.state_dict().values()) == model + mtp
    cfg = load_run_config(write_run(tmp_path, src, "[parallel]\nfsdp = true\n[moe]\nmtp_weight = 0.3\n"), [])
    params = plan_inputs(cfg, 2, "cpu")[0]
    assert {p.block for p in params if p.name.startswith("mtp.")} == {None}


def test_the_cli_plans_a_hybrid_s_deltanet_layers_and_says_what_is_estimated(tiny_factory, tmp_path, monkeypatch):
    """kiln plan feeds the Gated DeltaNet formula (memory_hybrid) for a Qwen3-Next: its activation term is larger
    than with the layers counted as attention blocks; it prints the family's note on what is still estimated (the
    MoE layers); a Qwen3 plan has no such note (control)."""
    from typer.testing import CliRunner

    from kiln.cli.main import app

    for model_type, noted in (("qwen3_next", True), ("qwen3", False)):
        cfg = write_run(tmp_path, tiny_factory(model_type, "causal-lm"))
        r = CliRunner().invoke(app, ["plan", "--config", str(cfg), "--nproc", "2", "--set", "parallel.fsdp=true"])
        assert r.exit_code == 0 and "weights" in r.output, r.output
        assert ("partly estimated" in r.output and "generic MoE estimate" in r.output) == noted, r.output
    cfg = write_run(tmp_path, tiny_factory("qwen3_next", "causal-lm"))

    def activations(output):
        line = next(ln for ln in output.splitlines() if ln.strip().startswith("activations"))
        return line.split()[1:]

    fed = CliRunner().invoke(app, ["plan", "--config", str(cfg)])
    from kiln.parallel import memory_hybrid
    monkeypatch.setattr(memory_hybrid.HybridDims, "from_config", classmethod(lambda cls, c: None))
    unfed = CliRunner().invoke(app, ["plan", "--config", str(cfg)])
    assert fed.exit_code == 0 and unfed.exit_code == 0, (fed.output, unfed.output)
    assert activations(fed.output)[1] == activations(unfed.output)[1] == "MiB", (fed.output, unfed.output)
    assert float(activations(fed.output)[0]) > float(activations(unfed.output)[0]), (fed.output, unfed.output)


def test_hybrid_formula_matches_autograd_saved_tensors():
    """The Qwen3.5 hybrid's blocks (kiln.parallel.memory_hybrid) against the bytes autograd saves in each: a
    gated-attention and a Gated DeltaNet block, the DeltaNet on the fast path (`kiln train`'s exact = false) and
    the reference one (exact = true), full and LoRA (adapters on both kinds of layer), fp32 and bf16, per token
    (the difference of batch 4 and 2, which drops the per-layer float32 norm scales): equal to the byte.
    T = 80 pads the last chunk of both rules (3 x 32, 2 x 64)."""
    from kiln.models.auto import AutoConfig, from_config
    from kiln.models.common.fast import set_fast
    from kiln.models.common.lora import LoraConfig, apply_lora
    types = ["linear_attention", "full_attention", "linear_attention"]
    hf = dict(vocab_size=40, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, layer_types=types,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_conv_kernel_dim=4)
    targets = ["q_proj", "v_proj", "in_proj_qkv", "out_proj"]

    def saved(rows: int, dtype: torch.dtype, lora: bool, fast: bool) -> list[int]:
        model = from_config(AutoConfig.for_model("qwen3_5_text", **hf), task="causal-lm", seed=0).to(dtype)
        if lora:
            apply_lora(model, LoraConfig(4, 8, 0.0, targets))
        set_fast(model, fast)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        packed, current = [], [None]
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
            layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))

        def pack(t):
            packed.append((current[0], weakref.ref(t)))
            return t

        ids = torch.randint(0, 40, (rows, 80), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)  # noqa: F841 (keeps the graph alive)
            # what the graph still holds once the forward is done: a node dropped in the forward (the reference
            # rule's final state) frees what it saved, and the allocator may hand that address to a later tensor
            kept: dict[int, tuple[int | None, int]] = {}
            for layer, ref in packed:
                t = ref()
                if t is not None and t.untyped_storage().data_ptr() not in params:
                    kept.setdefault(t.untyped_storage().data_ptr(), (layer, t.untyped_storage().nbytes()))
        per_layer = [0] * len(types)
        for layer, nbytes in kept.values():
            if layer is not None:
                per_layer[layer] += nbytes
        return per_layer

    dims = ModelDims(hidden=24, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=40, vocab=40, qk_norm=True,
                     output_gate=True)
    hybrid = HybridDims.from_config(hf)
    assert hybrid.linear_layers == {0, 2}
    # the schedule transformers derives without layer_types; any other family (a Qwen3 config) has no DeltaNet
    bare = {k: v for k, v in hf.items() if k != "layer_types"}
    assert HybridDims.from_config({"text_config": {**bare, "num_hidden_layers": 8}}).linear_layers == {0, 1, 2, 4, 5, 6}
    assert HybridDims.from_config({"num_hidden_layers": 8, "hidden_size": 24}) is None
    for dtype, cb in ((torch.float32, 4), (torch.bfloat16, 2)):
        for lora in (False, True):
            attn_targets = {"q_proj", "v_proj"} if lora else set()
            delta_targets = {"in_proj_qkv", "out_proj"} if lora else set()
            for fast in (True, False):
                two, four = saved(2, dtype, lora, fast), saved(4, dtype, lora, fast)
                attn, delta = ((four[i] - two[i]) / 160 for i in (1, 2))  # layers past the first adapted one
                assert attn == block_activation_bytes(dims, cb, not lora, attn_targets, 4), (dtype, lora)
                want = deltanet_block_bytes(dims, hybrid, cb, not lora, delta_targets, 4, 80, exact=not fast)
                assert delta == pytest.approx(want, rel=1e-12, abs=0), (dtype, lora, fast)


def test_plan_counts_deltanet_blocks_by_their_formula():
    """plan_memory(hybrid=...) counts each linear-attention block by deltanet_block_bytes (its own path: exact
    follows [train] exact) and the rest as before; without `hybrid` every block is an attention block."""
    hybrid = HybridDims(key_heads=1, key_dim=4, value_heads=2, value_dim=4, linear_layers=frozenset({1}))
    for exact in (False, True):
        s = RunSettings(nproc=1, batch_size=2, seq_len=8, exact=exact)
        attn = plan(s).ranks[0].terms["activations"]
        mixed = plan(s, hybrid=hybrid).ranks[0].terms["activations"]
        per_token = deltanet_block_bytes(DIMS, hybrid, 4, True, set(), 0, 8, exact=exact) - \
            block_activation_bytes(DIMS, 4, True, set(), 0)
        assert per_token > 0 and abs(mixed - attn - 16 * per_token) <= 1, exact  # the terms are whole bytes
