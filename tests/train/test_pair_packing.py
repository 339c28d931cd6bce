"""data.pack for DPO (sigmoid, hinge, IPO, SimPO, ORPO), KTO and reward models (kiln.train.packing): a micro-batch's
sequences packed into rows give the losses and gradients of the padded batch within float32 rounding, estimated
per tensor against the padded batch in float64 (tests/models/rounding.py); a packing whose positions run on across
sequences (the control) is off by far more. A model that cannot keep packed samples apart: refused by message when
pack = true was asked for, else each row holds one sequence."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.data.loader import pad_collate
from kiln.errors import ConfigError
from kiln.interop.tiny import TINY
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common.fast import set_fast
from kiln.train.config import load_run_config
from kiln.train.packing import lay_out, layout_logps, settle_pack
from kiln.train.recipes.dpo import DPORun, DPOSection, PreferenceData, pair_layout
from kiln.train.recipes.kto import KTORun, KTOSection
from kiln.train.recipes.reward_model import RewardRun, RewardSection
from tests.models.rounding import HEADROOM, ORDER, assert_all_within, assert_within, rounding_error
from tests.train.dpo_helpers import QWEN3, arithmetic_pairs, make_tokenizer, write_jsonl

VOCAB = 61
LENGTHS = dict(prompt=(1, 9), reply=(1, 30))  # mixed lengths: a padded batch here is mostly padding


def tiny(task: str = "causal-lm", seed: int = 0):
    cfg = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                               pad_token_id=0, num_labels=1)
    return set_fast(from_config(cfg, task=task, seed=seed))  # the chunked head training runs


def _ids(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=g)


def _len(g: torch.Generator, span: tuple[int, int]) -> int:
    return int(torch.randint(span[0], span[1] + 1, (1,), generator=g))


def pair_batch(n: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """DPO / reward-model examples (the shape kiln.data.preference gives) of mixed lengths, collated."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = _ids(g, _len(g, LENGTHS["prompt"]))
        ex = {}
        for side in ("chosen", "rejected"):
            seq = torch.cat([prompt, _ids(g, _len(g, LENGTHS["reply"]))])
            ex[f"{side}_ids"], ex[f"{side}_len"] = seq, torch.tensor(len(seq))
            ex[f"{side}_mask"] = (torch.arange(len(seq)) >= len(prompt)).long()
        ex["index"] = torch.tensor(i)
        out.append(ex)
    return pad_collate(out)


def unpaired_batch(n: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """KTO examples (kiln.data.kto's shape) of mixed lengths, both labels, collated."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = _ids(g, _len(g, LENGTHS["prompt"])), _ids(g, _len(g, LENGTHS["reply"]))
        out.append({"prompt_ids": p, "completion_ids": c, "prompt_len": torch.tensor(len(p)),
                    "completion_len": torch.tensor(len(c)), "label": torch.tensor(i % 3 != 2),
                    "index": torch.tensor(i)})
    return pad_collate(out)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(run_fn, model, ref, tokens: int, what: str) -> None:
    """run_fn(model, ref, pack) -> per-item outputs (losses first; summed for the backward): packed vs padded
    within the float32 rounding of the padded batch, measured against it in float64."""
    results = {}
    for name, m, r, pack in (("padded", model, ref, False), ("packed", model, ref, True),
                             ("float64", copy.deepcopy(model).double(),
                              copy.deepcopy(ref).double() if ref is not None else None, False)):
        m.zero_grad(set_to_none=True)
        outs = run_fn(m, r, pack)
        outs[0].sum().backward()
        results[name] = ([o.detach() for o in outs], _grads(m))
    (pad, pad_g), (got, got_g), (ref64, ref64_g) = results["padded"], results["packed"], results["float64"]
    for i, (a, b, c) in enumerate(zip(got, pad, ref64)):
        assert_within(a, b, rounding_error(b, c, tokens), f"{what}: output {i}")
    assert_all_within(got_g, pad_g, ref64_g, tokens, f"{what}: gradient")


def test_lay_out_packs_rows_no_wider_than_the_longest():
    g = torch.Generator().manual_seed(3)
    lengths = [5, 17, 9, 3, 12, 20, 1, 8]
    ids = [_ids(g, n) for n in lengths]
    masks = {"m": [(torch.arange(n) >= 2).long() for n in lengths]}
    padded, packed = lay_out(ids, masks, False, pad_id=0), lay_out(ids, masks, True, pad_id=0)
    assert padded.input_ids.shape == (8, 20) and padded.position_ids is None and not padded.packed
    assert packed.input_ids.shape[1] == 20 and packed.input_ids.shape[0] < 8 and packed.attention_mask is None
    assert packed.tokens() == padded.tokens() == sum(lengths)
    for lay in (padded, packed):
        for i, n in enumerate(lengths):
            r, c = lay.seq.eq(i).nonzero(as_tuple=True)
            assert len(r) == n and r.unique().numel() == 1  # one row, contiguous, in order
            assert torch.equal(lay.input_ids[r, c], ids[i]) and torch.equal(c, torch.arange(n) + c[0])
            assert lay.last[:, i].tolist() == [int(r[-1]), int(c[-1])]
            # the target at each position is the next token of the same sequence: the mask shifted by one
            assert lay.scored["m"][r, c].tolist() == masks["m"][i][1:].bool().tolist() + [False]
            if lay.packed:
                assert lay.position_ids[r, c].tolist() == list(range(n))
    assert packed.count("m").tolist() == [max(n - 2, 0) for n in lengths]
    assert not packed.scored["m"][packed.seq < 0].any()


def test_packing_without_restarting_positions_is_caught():
    """The control: the same rows with positions running on across sequences (the model then attends across them)
    are off by several times the rounding bound the tests below allow (a tiny random model mixes little)."""
    model = tiny()
    lay = pair_layout(pair_batch(), pack=True)
    with torch.no_grad():
        good = lay.per_sequence(layout_logps(model, lay, "comp"))
        lay.position_ids = torch.arange(lay.input_ids.shape[1]).expand_as(lay.input_ids).contiguous()
        bad = lay.per_sequence(layout_logps(model, lay, "comp"))
        want64 = pair_layout(pair_batch(), pack=False)
        ref64 = want64.per_sequence(layout_logps(copy.deepcopy(model).double(), want64, "comp"))
    bound = HEADROOM * (1 + ORDER) * rounding_error(good, ref64, lay.tokens())  # what assert_within allows
    assert float((good - bad).abs().max()) > 3 * bound


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo", "orpo"])
def test_dpo_packed_equals_padded(loss_type):
    batch = pair_batch()
    ref = None if loss_type in ("simpo", "orpo") else tiny(seed=1).eval()

    def run(model, reference, pack):
        r = DPORun(DPOSection(loss_type=loss_type, beta=0.3), [], None, None, pack)
        r.ref_model = reference
        pl, _ = r.pair_losses(model, batch, "train")
        return pl.losses, pl.chosen_logps, pl.rejected_logps, pl.chosen_rewards

    tokens = int(batch["chosen_len"].sum() + batch["rejected_len"].sum())
    _compare(run, tiny(), ref, tokens, f"dpo {loss_type}")


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_packed_equals_padded(loss_type):
    batch = unpaired_batch()

    def run(model, reference, pack):
        r = KTORun(KTOSection(loss_type=loss_type), 64, None, None, pack)
        r.ref_model = reference
        losses, info = r.row_losses(model, batch)
        return losses, info["kl"].reshape(1), info["logps"]

    tokens = 2 * int(batch["prompt_len"].sum() + batch["completion_len"].sum())  # the rows and the KL pairs
    _compare(run, tiny(), tiny(seed=1).eval(), tokens, f"kto {loss_type}")


def test_reward_model_packed_equals_padded():
    batch = pair_batch(seed=1)
    batch["margin"] = torch.linspace(-0.5, 0.5, batch["index"].shape[0])

    def run(model, _, pack):
        r = RewardRun(RewardSection(center_rewards_coefficient=0.01), 0, None, pack)
        losses, chosen, rejected, _ = r.pair_losses(model, batch)
        return losses, chosen, rejected

    tokens = int(batch["chosen_len"].sum() + batch["rejected_len"].sum())
    _compare(run, tiny("sequence-classification"), None, tokens, "reward model")


def test_a_model_that_cannot_keep_samples_apart_is_refused_or_unpacked(tmp_path):
    mamba = from_config(AutoConfig.for_model("mamba", **TINY["mamba"]), task="causal-lm", seed=0)
    assert not mamba.packs_samples() and tiny().packs_samples()
    asked = PreferenceData(train=str(tmp_path / "x.jsonl"), pack=True)
    with pytest.raises(ConfigError, match="data.pack = true: mamba-tiny does not keep packed samples apart"):
        settle_pack(asked, mamba, "mamba-tiny")
    said: list[str] = []
    default = PreferenceData(train=str(tmp_path / "x.jsonl"))
    settle_pack(default, mamba, "mamba-tiny", said.append)
    assert default.pack is False
    assert said == ["data.pack: mamba-tiny does not keep packed samples apart, so each row holds one sample"]
    settle_pack(kept := PreferenceData(train=str(tmp_path / "x.jsonl")), tiny(), "qwen3")
    assert kept.pack is True


@pytest.mark.parametrize("table", ["dpo", "kto"])  # no family that mixes samples has a reward head
def test_pack_true_on_a_mamba_run_is_refused_before_work(tmp_path, table):
    rows = arithmetic_pairs(8)
    make_tokenizer(tmp_path, rows)
    if table == "kto":
        rows = [{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows]
    write_jsonl(tmp_path / "train.jsonl", rows)
    config = "\n".join(f"{k} = {v}" for k, v in {**TINY["mamba"], "vocab_size": QWEN3["vocab_size"]}.items())
    (tmp_path / "run.toml").write_text(f"""[model]
family = "mamba"
task = "causal-lm"
tokenizer = "{tmp_path / 'tok'}"
[model.config]
{config}
[data]
train = "{tmp_path / 'train.jsonl'}"
max_length = 40
pack = true
[train]
out_dir = "{tmp_path / 'out'}"
steps = 1
batch_size = 2
[{table}]
""")
    from kiln.train.run import build_trainer

    with pytest.raises(ConfigError, match="data.pack = true: mamba does not keep packed samples apart"):
        build_trainer(load_run_config(tmp_path / "run.toml"))
    assert not (tmp_path / "out").exists()
