"""DeepSeek-V4's checkpoint side: the tensor names on disk and what both task models do on load and save.

- `V4_KEYS` (and the per-head lists): kiln's module names -> the names transformers writes for V4;
  the later rules of each head's list are read-only aliases, so DeepSeek's own release layout loads too;
- `release_name`: a causal LM's name as DeepSeek's release writes it (no `model.`, `embed`, `head`,
  `hc_head_fn`), kept for a checkpoint read in that layout; the MLA key/value norm is read as the release's
  `attn.kv_norm` or transformers' `attn.norm` (the key map's write name; the release's is a read alias) and
  written back as read (`release_kv_norm`);
- `V4TaskModel`: the `mtp.*` tensors carried through (or handed to the live MTP layer), and the
  hyper-connection, sink, position-bias and norm parameters held in float32, written back in the
  half dtype they were stored in while that is lossless.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from kiln.models.keymap import Stack
from kiln.models.tasks import BASE

MTP_TENSOR = re.compile(r"(^|\.)mtp\.")
# Parameters transformers keeps in float32 under a half-precision model (its _keep_in_fp32_modules_strict);
# the routers' balancing bias keeps itself (moe_routing.GroupLimitedRouter).
KEEP_FP32 = re.compile(r"attn_hc|ffn_hc|hc_head|sinks|position_bias|norm")
# The MLA key/value norm in the release's spelling (a read alias in the key map), and in transformers' (the key map's
# write name): a checkpoint read in the release's is written back in it.
RELEASE_KV_NORM = re.compile(r"(^|\.)attn\.kv_norm\.")
TRANSFORMERS_KV_NORM = re.compile(r"(^|\.)attn\.norm\.")


if TYPE_CHECKING:  # the mixin always sits in front of a kiln task model (V4Model, V4ForCausalLM)
    from kiln.models.pretrained import PreTrainedModel as _MixedInto
else:
    _MixedInto = object


class V4TaskModel(_MixedInto):
    """What both heads add: `mtp.*` checkpoint tensors (transformers skips them) written back as read, the
    checkpoint's layout kept (DeepSeek's own release: no `model.` prefix, `embed`, `head`, `hc_head_fn`), and the
    hyper-connection, sink, position-bias and norm parameters held in float32 whatever dtype the rest takes."""

    # A sharded read may hold the FP8 (FP4) MTP weights a whole load dequantizes as their stored pairs, by reference
    # (kiln.parallel.sharded_carried): an export kept FP8 writes them as held (the release's bytes, as a whole load's
    # export writes its unchanged pairs back), one with no FP8 dequantized as read; `mtp_carried` takes them as
    # dequantized (common/fp8.carried_as_loaded).
    carries_fp8_pairs = True
    # set by load_hf_state_dict (absent on a model never loaded: hf_state_dict reads them with defaults)
    mtp_tensors: dict[str, torch.Tensor]
    release_layout: bool
    release_kv_norm: bool

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor], source: str = "checkpoint",
                           source_task: str | None = None):
        # the name each tensor is written back under before the layout's renames (as prepare_fp8 keys FP8 pairs)
        prefix = "" if self.task == BASE else self.family.hf_prefix + "."
        out_name = {k: prefix + n if extra else n for k, (n, extra) in self.normalise_hf_names(hf).items()}
        mtp = {k: v for k, v in hf.items() if MTP_TENSOR.search(k)}
        report = super().load_hf_state_dict({k: v for k, v in hf.items() if k not in mtp}, source, source_task)
        self.mtp_tensors = {out_name[k]: v for k, v in mtp.items()}
        self.release_layout = self.task != BASE and not any(k.startswith(prefix) for k in hf)
        # the key/value norm written back under the name read: the release's `attn.kv_norm`, else (read as
        # `attn.norm`, or nothing read) the name transformers writes
        self.release_kv_norm = any(RELEASE_KV_NORM.search(k) for k in hf)
        self.stored_half = {}  # kiln name -> the half dtype it was stored in: written back in it
        for name, p in self.named_parameters():
            if KEEP_FP32.search(name) and p.dtype in (torch.float16, torch.bfloat16):  # stored in half precision
                self.stored_half[name] = p.dtype
                p.data = p.data.float()
        return report

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        hf = super().hf_state_dict()
        keymap = self.family.keymap(self.task)
        for name, dtype in getattr(self, "stored_half", {}).items():
            key = keymap.hf_name(name)
            # back in the stored dtype while that is lossless (untouched); a trained value keeps its float32
            if key in hf and hf[key].dtype == torch.float32 and torch.equal(hf[key].to(dtype).float(), hf[key]):
                hf[key] = hf[key].to(dtype)
        mtp = dict(getattr(self, "mtp_tensors", {}))
        if self.fp8_state is not None:  # dequantized at load: back to FP8 / FP4 + scales
            mtp = self.fp8_state.export(mtp)
        if getattr(self, "release_kv_norm", False):  # before the MTP tensors join: those keep the names read
            hf = {TRANSFORMERS_KV_NORM.sub(r"\1attn.kv_norm.", k): v for k, v in hf.items()}
        hf.update(mtp)
        if getattr(self, "release_layout", False):
            hf = {release_name(k): v for k, v in hf.items()}
        return hf

    def _apply(self, fn, recurse: bool = True):
        kept = {n: p.data for n, p in self.named_parameters() if KEEP_FP32.search(n) and p.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, p in self.named_parameters():
            if name in kept and p.is_floating_point() and p.dtype != torch.float32:
                p.data = kept[name].to(p.device)  # the float32 values themselves, not a round trip through half
        return self


def release_name(name: str) -> str:
    """A causal LM's tensor name as DeepSeek's release writes it: no `model.` prefix, `embed`, `hc_head_fn`."""
    name = name.removeprefix("model.")
    if name.startswith("embed_tokens."):
        return "embed." + name[len("embed_tokens."):]
    if name.startswith("hc_head.hc_"):
        return "hc_head_" + name[len("hc_head.hc_"):]
    return "head." + name[len("lm_head."):] if name.startswith("lm_head.") else name


def _layer(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(f"layers.{{}}.{k}", f"layers.{{}}.{h}") for k, h in pairs]


# kiln (HF module) names -> the names transformers writes to disk for V4
V4_KEYS: list[Stack | tuple[str, str]] = [
    Stack("layers.{}.mlp.experts.gate_up_proj",
          ("layers.{}.ffn.experts.{}.w1.weight", "layers.{}.ffn.experts.{}.w3.weight")),
    Stack("layers.{}.mlp.experts.down_proj", ("layers.{}.ffn.experts.{}.w2.weight",)),
    *_layer([
        ("self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"),
        ("self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"),
        ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
        ("self_attn.compressor.indexer.kv_proj", "attn.indexer.compressor.wkv"),
        ("self_attn.compressor.indexer.gate_proj", "attn.indexer.compressor.wgate"),
        ("self_attn.compressor.indexer.kv_norm", "attn.indexer.compressor.norm"),
        ("self_attn.compressor.position_bias", "attn.compressor.ape"),
        ("self_attn.compressor.kv_proj", "attn.compressor.wkv"),
        ("self_attn.compressor.gate_proj", "attn.compressor.wgate"),
        ("self_attn.compressor.kv_norm", "attn.compressor.norm"),
        ("self_attn.sinks", "attn.attn_sink"),
        ("self_attn.q_a_proj", "attn.wq_a"),
        ("self_attn.q_a_norm", "attn.q_norm"),
        ("self_attn.q_b_proj", "attn.wq_b"),
        ("self_attn.kv_proj", "attn.wkv"),
        # the name transformers' reverse renaming writes (`.norm.` <- `.kv_norm.`), and the release's (its weight
        # index: layers.N.attn.kv_norm.weight) read too; a save writes the one read (V4TaskModel.hf_state_dict)
        ("self_attn.kv_norm", "attn.norm"),
        ("self_attn.kv_norm", "attn.kv_norm"),
        ("self_attn.o_a_proj", "attn.wo_a"),
        ("self_attn.o_b_proj", "attn.wo_b"),
        ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
        ("mlp.gate", "ffn.gate"),
        ("mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"),
        ("mlp.shared_experts.down_proj", "ffn.shared_experts.w2"),
        ("mlp.shared_experts.up_proj", "ffn.shared_experts.w3"),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
        ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ]),
    ("norm", "norm"),
]

# The embedding and the hyper head are named apart per head, as transformers writes them: a bare model in
# DeepSeek's own names (`embed`, `hc_head_fn`), a causal LM under `model.` in its module names. The later
# rules of each list are read-only aliases, so either layout loads (DeepSeek's own checkpoints included).
_HC_HEAD = ("hc_fn", "hc_base", "hc_scale")
BASE_KEYS = [("model.embed_tokens", "embed"), *((f"model.hc_head.{p}", f"hc_head_{p[3:]}") for p in _HC_HEAD),
             ("model.embed_tokens", "embed_tokens"), ("model.hc_head", "hc_head")]
# the MTP block in the release's names: a layer's own, under mtp.{} instead of layers.{}, and its extra parts
MTP_KEYS: list[Stack | tuple[str, str]] = [Stack(s.kiln.replace("layers.", "mtp.", 1), tuple(h.replace("layers.", "mtp.", 1) for h in s.hf))
            for s in V4_KEYS if isinstance(s, Stack)] \
    + [(k.replace("layers.", "mtp.", 1), h.replace("layers.", "mtp.", 1)) for r in V4_KEYS
       if not isinstance(r, Stack) for k, h in [r] if k.startswith("layers.")] \
    + [(f"mtp.{{}}.{p}", f"mtp.{{}}.{p}") for p in ("e_proj", "h_proj", "enorm", "hnorm", "norm")] \
    + [(f"mtp.{{}}.hc_head.{p}", f"mtp.{{}}.hc_head_{p[3:]}") for p in _HC_HEAD]
CAUSAL_KEYS = [*MTP_KEYS, ("lm_head", "head"), ("model.embed_tokens", "model.embed_tokens"), ("model.hc_head", "model.hc_head"),
               ("model.embed_tokens", "model.embed"),
               *((f"model.hc_head.{p}", f"model.hc_head_{p[3:]}") for p in _HC_HEAD), ("lm_head", "model.head"),
               # read-only: the MTP block under the `model.` a release's bare names take when read as a causal LM's
               # (normalise_hf_names), where a sharded read looks for a live MTP module's tensors
               *(Stack(r.kiln, tuple("model." + h for h in r.hf)) if isinstance(r, Stack) else (r[0], "model." + r[1])
                 for r in MTP_KEYS)]
