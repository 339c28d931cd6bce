"""verify-export for a GGUF file: llama.cpp (llama-cpp-python) loads it and must compute what kiln computes.

Checks, each printed with its numbers:
- the file loads; llama.cpp's tokenizer gives kiln's ids for fixed texts (BOS/EOS added as kiln adds them);
- f32: logits on the fixed prompts equal kiln's within 1e-4 relative (max |a - b| / max |kiln|);
- f16 / bf16: 32 greedy tokens on each prompt equal kiln's;
- q8_0 / K-quants: top-1 agreement and mean KL(kiln || llama.cpp) over 512 positions, against a bound
  estimated from the file itself (see `_kl_bound`); every position whose top-2 margin is wider than the
  error estimate must agree;
- an embedding encoder (BERT, ModernBERT): pooled vectors instead of logits (kiln.interop.gguf_verify_embed);
- the chat template: the GGUF carries kiln's template; llama.cpp's built-in renderer (where it knows the
  layout) and llama-cpp-python's Jinja renderer (a system prompt, two turns and a tool call) give text that
  tokenizes to kiln's ids; the template's end-of-turn token and EOS end generation in llama.cpp.
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kiln.errors import KilnError
from kiln.interop.gguf_arch import gguf_family, gguf_tensors
from kiln.interop.gguf_export import GGUF_TYPES, _plain_model
from kiln.interop.gguf_routing import explain_by_routing
from kiln.interop.gguf_vocab import chat_format
from kiln.interop.verify import Check
from kiln.models.common.config import text_sizes
from kiln.models.pretrained import PreTrainedModel

PROMPTS = [
    "Paris is the capital of France.", "hello world, how are you?", "the cat sat on the mat",
    "Once upon a time", "The king and the queen", "1 2 3 4 5", "What is the weather today?",
    "a dog runs by the river", "Good night!", "tell me a story about the sea",
]
F32_REL = 1e-4
# the largest relative RMS error of a stored matrix per type: a uniform rounding step over sqrt(12), the step being
# a block's range (about 2 x 2.5 RMS for Gaussian-like weights) over the type's levels (q8_0: 255, q6_k: 63,
# q5_k: 31, q4_k: 15), times 1.5 headroom; the _m mixes keep some tensors at a finer type, never coarser
WEIGHT_REL = {"q8_0": 0.009, "q6_k": 0.035, "q5_k_m": 0.07, "q4_k_m": 0.15}
# f16 / bf16 activations as llama.cpp's CPU matmuls round them (half an ulp relative)
ACT_REL = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}
N_GREEDY = 32
N_KL_POSITIONS = 512
CONVERSATION: list[dict[str, Any]] = [  # chat messages: JSON objects
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 18}"},
    {"role": "assistant", "content": "It is 18 degrees."},
    {"role": "user", "content": "Thanks!"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise KilnError("verify-export of a GGUF needs llama.cpp: pip install 'kiln[gguf]' (llama-cpp-python)") from None
    return llama_cpp


def file_type_name(path: str | os.PathLike) -> str:
    """The --gguf-type the file was written as (general.file_type)."""
    reader = gguf.GGUFReader(str(path))
    field = reader.get_field(gguf.Keys.General.FILE_TYPE)
    if field is None:
        raise KilnError(f"{path}: no general.file_type in the GGUF")
    ft = int(field.contents())
    names = [n for n, t in GGUF_TYPES.items() if int(t.file_type) == ft]
    if not names:
        raise KilnError(f"{path}: file type {ft} is not one kiln writes ({', '.join(GGUF_TYPES)})")
    return names[0]


def _load(path: Path, n_ctx: int, lora: Path | None = None):
    llama_cpp = _llama_cpp()
    try:
        # the KV cache in f32 (llama.cpp's default is f16, which alone moves logits ~1e-3 relative): the check is
        # of the file's weights, not of the cache's precision
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                               verbose=False, n_threads=1, n_threads_batch=1, seed=0, type_k=llama_cpp.GGML_TYPE_F32,
                               type_v=llama_cpp.GGML_TYPE_F32,
                               lora_path=None if lora is None else str(lora))
    except (ValueError, RuntimeError) as e:
        raise KilnError(f"{path}: llama.cpp cannot load it: {e}") from None


def _llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def _kiln_logits(model: PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double().numpy()


def _greedy(step, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(np.argmax(step(out))))
    return out[len(ids):]


def _weight_error(path: Path, fam, model: PreTrainedModel) -> float:
    """The largest relative RMS error of any matrix as stored in the file (dequantized by the gguf package)."""
    source = {name: t.detach().float().numpy() for name, _, t in gguf_tensors(fam, model.config, model.hf_state_dict())}
    worst = 0.0
    for t in gguf.GGUFReader(str(path)).tensors:
        ref = source.get(t.name)
        if ref is None or ref.ndim < 2 or t.tensor_type == gguf.GGMLQuantizationType.I32:  # index tables: exact
            continue
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ref.shape)
        worst = max(worst, float(np.sqrt(((got - ref) ** 2).mean() / max((ref ** 2).mean(), 1e-30))))
    return worst


def _kl_bound(weight_err: float, logits: np.ndarray, n_layers: int,
              act: float = 2.5 / (127 * math.sqrt(12))) -> tuple[float, float]:
    """(mean-KL bound, logit error estimate). llama.cpp also rounds each matmul's activations to 8 bits
    (q8_0 / q8_K blocks, RMS relative error about 1/(127 sqrt 12) ~ 0.23%, times ~2.5 for a block's max over
    its RMS); relative errors of the two layers per block add up in quadrature over the depth, and a logit
    error of RMS s changes KL by about s^2 / 2 times the softmax's spread (<= 1 per unit of logit variance).
    Headroom 3x on s."""
    rel = math.sqrt((weight_err ** 2 + act ** 2) * 2 * (n_layers + 1))
    s = 3 * rel * float(logits.std(axis=-1).mean())
    return s * s / 2, s


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def verify_gguf(path: str | os.PathLike, model: PreTrainedModel, prompts: list[str] | None = None,
                n_greedy: int = N_GREEDY, n_kl_positions: int = N_KL_POSITIONS,
                lora: str | os.PathLike | None = None) -> list[Check]:
    """Every check for one GGUF file against `model` (kiln's, run in float32 on the CPU, a LoRA model merged);
    with `lora`, llama.cpp runs the GGUF adapter file over the base file `path`."""
    path = Path(path)
    for p in (path, lora):
        if p is not None and not Path(p).is_file():
            raise KilnError(f"{p}: no such GGUF file")
    llama_cpp = _llama_cpp()
    prompts = prompts or PROMPTS
    type_name = file_type_name(path)
    model = _plain_model(model).float().eval()
    config, tok = model.config, model.tokenizer
    if tok is None:
        raise KilnError(f"{path}: the model has no tokenizer; the checks compare llama.cpp's ids with kiln's")
    fam = gguf_family(config.model_type, config)
    if fam.encoder:
        if lora is not None:
            raise KilnError("--lora: GGUF adapters are checked on decoders; merge an encoder's adapter instead")
        from kiln.interop.gguf_verify_embed import embedding_checks

        return embedding_checks(path, model, prompts, type_name)
    n_ctx = min(getattr(config, "max_position_embeddings", 512), 512)
    llm = _load(path, n_ctx, None if lora is None else Path(lora))
    adapter = f" + LoRA adapter {Path(lora).name}" if lora else ""
    checks = [Check("llama.cpp loads", llm.n_vocab() == text_sizes(config).vocab_size, f"{type_name}{adapter}, arch "
                    f"{llm.metadata.get('general.architecture')}, vocab {llm.n_vocab()}")]
    encoded = [tok.backend.encode(p, add_special_tokens=True).ids for p in prompts]
    theirs = [llm.tokenize(p.encode(), add_bos=True, special=False) for p in prompts]
    bad = [p for p, a, b in zip(prompts, encoded, theirs) if a != b]
    checks.append(Check("tokenizer", not bad, f"{len(prompts)} texts tokenize to kiln's ids"
                        if not bad else f"differ on {bad[:2]}: kiln {encoded[prompts.index(bad[0])]} "
                                        f"llama.cpp {theirs[prompts.index(bad[0])]}"))
    if type_name == "f32":
        worst = 0.0
        for ids in encoded:
            a, b = _llama_logits(llm, ids), _kiln_logits(model, ids)
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
        checks.append(Check("f32 logits", worst <= F32_REL, f"{len(encoded)} prompts, max relative difference "
                            f"{worst:.3g} (bound {F32_REL:g})"))
    elif type_name in ("f16", "bf16"):
        checks.append(_greedy_check(llm, model, encoded, n_greedy, n_ctx, type_name))
    else:
        checks += _quant_checks(path, fam, llm, model, n_kl_positions, n_ctx, type_name)
    if tok.chat_template:
        checks += _chat_checks(llm, llama_cpp, model)
    return checks


def _greedy_check(llm, model, encoded: list[list[int]], n: int, n_ctx: int, type_name: str) -> Check:
    """Kiln's greedy tokens (f32) against llama.cpp's. A step where they part is a rounding tie, not a failure,
    only when kiln's margin between the two tokens is under the logit error the type's rounding explains
    (weights and activations each half an ulp, over 2 matmuls a layer, 3x headroom; see `_kl_bound`). In a
    mixture-of-experts model it is a routing tie when kiln's own model, with one router near-tie (top-k edge
    experts closer than the same rounding explains, at or before that step) flipped, gives llama.cpp's token
    (see gguf_routing); a dense model has no routers, so nothing else passes there."""
    layers = model.config.num_hidden_layers

    def error(logits: np.ndarray) -> np.ndarray:  # per row of a (T, V) or (T, E) array
        rel = math.sqrt(2 * ACT_REL[type_name] ** 2 * 2 * (layers + 1))
        return 3 * rel * logits.std(axis=-1)

    diverged: list[str] = []
    ties: list[str] = []
    routing: list[str] = []
    for i, ids in enumerate(encoded):
        n_new = min(n, n_ctx - len(ids))
        ours = _greedy(lambda s: _kiln_logits(model, s)[-1], ids, n_new)
        theirs = _greedy(lambda s: _llama_logits(llm, s)[-1], ids, n_new)
        if ours != theirs:
            k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            logits = _kiln_logits(model, ids + ours[:k])[-1]
            margin = float(logits[ours[k]] - logits[theirs[k]])
            s = float(error(logits[None])[0])
            where = f"prompt {i + 1} step {k}: kiln {ours[k]} llama.cpp {theirs[k]} (kiln's margin {margin:.3g}, " \
                    f"rounding explains {s:.3g}"
            if margin <= s:
                ties.append(where + ")")
                continue
            why = explain_by_routing(model, ids + ours[:k], ours[k], theirs[k], s, error)
            (routing if why else diverged).append(where + (f"; {why})" if why else ")"))
    equal = len(encoded) - len(diverged) - len(ties) - len(routing)
    detail = f"{len(encoded)} prompts x {n} tokens: {equal} equal"
    if ties:
        detail += f", {len(ties)} part at a rounding tie ({ties[0]})"
    if routing:
        detail += f", {len(routing)} part at a routing tie ({routing[0]})"
    if diverged:
        detail += f", {len(diverged)} differ: {diverged[:2]}"
    return Check(f"greedy {n} tokens", not diverged, detail)


def _quant_checks(path, fam, llm, model, n_positions: int, n_ctx: int, type_name: str) -> list[Check]:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ours, theirs = [], []
    left = n_positions
    while left > 0:
        n = min(left, n_ctx)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        ours.append(_kiln_logits(model, ids))
        theirs.append(_llama_logits(llm, ids))
        left -= n
    a, b = np.concatenate(ours), np.concatenate(theirs)
    kl = float(_kl(a, b).mean())
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    err = _weight_error(path, fam, model)
    bound, s = _kl_bound(min(err, WEIGHT_REL[type_name]), a, model.config.num_hidden_layers)
    srt = np.sort(a, axis=-1)
    decisive = (srt[:, -1] - srt[:, -2]) > 2 * s
    agree_decisive = bool((a.argmax(-1) == b.argmax(-1))[decisive].all())
    return [Check(f"{type_name} weights", err <= WEIGHT_REL[type_name], f"worst relative RMS error of a stored "
                  f"matrix {err:.3g} (bound {WEIGHT_REL[type_name]:g} for {type_name})"),
            Check(f"{type_name} mean KL", kl <= bound, f"{len(a)} positions, mean KL {kl:.3g} (bound {bound:.3g})"),
            Check(f"{type_name} top-1", agree_decisive, f"top-1 agreement {top1:.4f}; all {int(decisive.sum())} "
                  f"positions with a top-2 margin over {2 * s:.3g} agree" if agree_decisive else
                  f"top-1 agreement {top1:.4f}; a position with margin over {2 * s:.3g} differs")]


def _chat_checks(llm, llama_cpp, model) -> list[Check]:
    tok = model.tokenizer
    template = tok.chat_template
    raw = llama_cpp.llama_model_chat_template(llm.model, None)
    embedded = raw.decode() if raw else None
    checks = [Check("chat template in the GGUF", embedded == template,
                    "tokenizer.chat_template is kiln's template" if embedded == template else "differs or missing")]
    kiln_tpl = tok.chat()

    def kiln_ids(messages, tools=None) -> list[int]:
        text = kiln_tpl.render(messages, add_generation_prompt=True, tools=tools)
        return tok.backend.encode(text, add_special_tokens=False).ids

    def llama_ids(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    plain = [m for m in CONVERSATION if "tool_calls" not in m and m["role"] != "tool"]
    msgs = (llama_cpp.llama_chat_message * len(plain))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in plain])
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(embedded.encode() if embedded else None, msgs, len(plain), True, buf,
                                            len(buf))
    if n < 0:
        checks.append(Check("llama.cpp built-in chat rendering", chat_format(tok) is None,
                            "llama.cpp's built-in templates do not know this layout (kiln does not translate it "
                            "either)" if chat_format(tok) is None else "llama.cpp refused a ChatML template"))
    else:
        ok = llama_ids(buf.raw[:n].decode()) == kiln_ids(plain)
        checks.append(Check("llama.cpp built-in chat rendering", ok, f"system + two turns: {n} bytes, "
                            + ("same ids as kiln's rendering" if ok else "ids differ from kiln's rendering")))
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    specials = tok.specials
    fmt = Jinja2ChatFormatter(template, eos_token=specials.get("eos_token", ""),
                              bos_token=specials.get("bos_token", ""), add_generation_prompt=True)
    try:
        ours = kiln_ids(CONVERSATION, TOOLS)
        convo = "system, two turns and a tool call"
    except KilnError as e:  # the model's own template takes no tool calls: the conversation without them
        ours, convo = kiln_ids(plain), f"system and two turns (the template renders no tool call: {e})"
    try:
        text = fmt(messages=CONVERSATION if convo.startswith("system, two") else plain, tools=TOOLS).prompt
        ok = llama_ids(text) == ours
        detail = f"{convo}: " + ("same ids as kiln's" if ok else "ids differ from kiln's")
    except Exception as e:  # noqa: BLE001 - llama-cpp-python's Jinja fails where kiln's rendered: said, not hidden
        ok, detail = False, f"llama-cpp-python cannot render what kiln rendered ({convo}): {e}"
    checks.append(Check("llama-cpp-python Jinja chat rendering", ok, detail))
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    turn = chat_format(tok)
    ends = {t: tok.backend.token_to_id(t) for t in ([specials["eos_token"]] if "eos_token" in specials else [])
            + list(turn.end_of_turn if turn else ())}
    not_eog = [t for t, i in ends.items() if i is None or not llama_cpp.llama_vocab_is_eog(vocab, i)]
    checks.append(Check("end-of-turn tokens end generation", bool(ends) and not not_eog,
                        f"{', '.join(ends)} end generation in llama.cpp" if ends and not not_eog
                        else f"not end-of-generation in llama.cpp: {not_eog or 'no end token known'}"))
    return checks
