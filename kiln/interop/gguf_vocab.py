"""GGUF tokenizer metadata and the Ollama Modelfile, from kiln's tokenizer of a model directory.

Written: `tokenizer.ggml.model` (byte-level BPE is llama.cpp's "gpt2", WordPiece its "bert"), `.pre` (the pre-tokenizer's split
rule, recognised from tokenizer.json: llama.cpp needs its name, a guess would split text differently),
tokens, merges, token types (added special tokens are CONTROL, other added tokens USER_DEFINED, ids past the
tokenizer up to the model's vocab_size UNUSED), BOS/EOS/PAD/UNK ids, whether BOS/EOS are added (measured
by encoding a text), the chat template, and the end-of-turn token.

WordPiece (BERT's tokenizer, `read_wordpiece`): llama.cpp's "bert" vocab marks word starts rather than
continuations, so a token `##x` is stored as `x` and any other non-special token `t` as `\u2581t`; the BERT
normaliser's lowercasing and accent stripping are keys (`tokenizer.ggml.normalizer.*`, off unless written);
[CLS] is the BOS and [SEP] the separator llama.cpp adds around every text, as BERT's post-processor does.

SentencePiece-style BPE (Llama 2, Mistral, TinyLlama: `byte_fallback`, "\u2581" for spaces, `read_sentencepiece`) is
llama.cpp's "llama" vocab: it merges the adjacent pair whose joined token scores highest, so a token's score is
minus the rank of the merge that makes it (the BPE order); `<0xXX>` tokens are BYTE (the fallback); llama.cpp
prepends the space the normaliser's Prepend("\u2581") adds (`add_space_prefix`).

The Modelfile's TEMPLATE is written only for a chat template recognised by rendering: kiln renders probe
conversations with the model's own template and compares them with a known layout's rendering (ChatML);
any other template gets a comment saying it was not translated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import gguf

from kiln.errors import KilnError
from kiln.hub import Tokenizer

# the split rule of tokenizer.json's pre-tokenizer -> llama.cpp's name for it (tokenizer.ggml.pre)
_GPT2_RULE = "ByteLevel(use_regex)"
_PRE_BY_RULE = {
    _GPT2_RULE: "gpt-2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


def _split_rule(pre: dict | None, where: str) -> str:
    """The regex (or the GPT-2 ByteLevel rule) a byte-level pre-tokenizer splits by."""
    if pre is None:
        raise KilnError(f"{where}: tokenizer.json has no pre-tokenizer; llama.cpp's BPE needs one it knows")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return _GPT2_RULE
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        splits = [p for p in parts if p.get("type") == "Split"]
        bytelevel = [p for p in parts if p.get("type") == "ByteLevel"]
        if len(splits) == 1 and len(bytelevel) == 1 and not bytelevel[0].get("use_regex", True) \
                and len(parts) == 2 and "Regex" in splits[0].get("pattern", {}):
            return splits[0]["pattern"]["Regex"]
    raise KilnError(f"{where}: tokenizer.json pre-tokenizer {json.dumps(pre)[:160]} is not one llama.cpp is known "
                    f"to split the same way")


@dataclass
class Vocab:
    model: str
    pre: str
    tokens: list[str]
    types: list[gguf.TokenType]
    merges: list[str]
    specials: dict[str, int]      # bos/eos/pad/unk/eot -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    end_of_turn: list[str]        # texts of the tokens that end an assistant turn
    wordpiece: dict | None = None  # "bert" vocabs: lowercase, strip_accents, sep / cls / mask ids, type count
    scores: list[float] | None = None  # "llama" (SentencePiece) vocabs: the merge priority of each token


def read_vocab(tok: Tokenizer, vocab_size: int, config_eos: list[int], where: str,
               sentencepiece: bool = False) -> Vocab:
    """Everything the GGUF tokenizer keys need, from a byte-level BPE tokenizer; other kinds refused by name.
    With `sentencepiece`, only the specials, BOS / EOS behaviour and chat template (read_sentencepiece's part)."""
    spec = json.loads(tok.backend.to_str())
    model = spec.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback") and not sentencepiece:
        return read_sentencepiece(tok, vocab_size, config_eos, where)
    if model.get("type") != "BPE":
        raise KilnError(f"{where}: tokenizer kind {model.get('type', '?')} is not exported to GGUF yet (kiln writes "
                        "byte-level BPE, llama.cpp's 'gpt2' vocab, as Llama 3 and Qwen use; SentencePiece-style "
                        "byte-fallback BPE as its 'llama' vocab; BERT's WordPiece as its 'bert' vocab)")
    found = "default" if sentencepiece else _PRE_BY_RULE.get(_split_rule(spec.get("pre_tokenizer"), where))
    if found is None:
        raise KilnError(f"{where}: the pre-tokenizer's split pattern is not one kiln maps to a llama.cpp "
                        f"pre-tokenizer ({', '.join(sorted(set(_PRE_BY_RULE.values())))})")
    n = tok.vocab_size
    if n > vocab_size:
        raise KilnError(f"{where}: tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")
    by_id = {i: t for t, i in tok.backend.get_vocab(with_added_tokens=True).items()}
    added = tok.backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    roles = {role: tok.token_id(f"{role}_token") for role in ("bos", "eos", "pad", "unk")}
    specials = {r: i for r, i in roles.items() if i is not None}
    if "eos" not in specials and config_eos:
        specials["eos"] = config_eos[0]
    probe = tok.backend.encode("a", add_special_tokens=True).ids
    plain = tok.backend.encode("a", add_special_tokens=False).ids
    add_bos = "bos" in specials and len(probe) > len(plain) and probe[0] == specials["bos"]
    add_eos = "eos" in specials and len(probe) > len(plain) and probe[-1] == specials["eos"]
    template = tok.chat_template
    fmt = chat_format(tok) if template else None
    end_of_turn = list(fmt.end_of_turn) if fmt else []
    eot = tok.backend.token_to_id(end_of_turn[0]) if end_of_turn else None
    if eot is not None:
        specials["eot"] = eot
    return Vocab("gpt2", found, tokens, types, merges, specials, add_bos, add_eos, template, end_of_turn)


def read_wordpiece(tok: Tokenizer, vocab_size: int, type_vocab_size: int, where: str) -> Vocab:
    """The "bert" vocab of a WordPiece tokenizer with BERT's normaliser and pre-tokenizer; others refused."""
    spec = json.loads(tok.backend.to_str())
    model, norm, pre = spec.get("model", {}), spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
    if model.get("continuing_subword_prefix", "##") != "##":
        raise KilnError(f"{where}: WordPiece continuing_subword_prefix {model['continuing_subword_prefix']!r}; "
                        "llama.cpp's bert vocab knows '##'")
    if norm.get("type") != "BertNormalizer" or pre.get("type") != "BertPreTokenizer":
        raise KilnError(f"{where}: WordPiece with normalizer {norm.get('type')} and pre-tokenizer {pre.get('type')}; "
                        "llama.cpp's bert vocab splits and normalises as BertNormalizer + BertPreTokenizer")
    if tok.vocab_size > vocab_size:
        raise KilnError(f"{where}: tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}")
    by_id = {i: t for t, i in tok.backend.get_vocab(with_added_tokens=True).items()}
    added = tok.backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added and added[i].special:
            tokens.append(t)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(t[2:] if t.startswith("##") else "\u2581" + t)
            types.append(gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    ids = {role: tok.token_id(f"{role}_token") for role in ("cls", "sep", "unk", "pad", "mask")}
    cls, sep = ids["cls"], ids["sep"]
    if cls is None or sep is None:
        raise KilnError(f"{where}: WordPiece tokenizer without cls_token / sep_token; llama.cpp adds both to every text")
    lowercase = bool(norm.get("lowercase", True))
    strip = norm.get("strip_accents")
    specials = {"bos": cls, **{r: tid for r in ("unk", "pad") if (tid := ids[r]) is not None}}
    return Vocab("bert", "default", tokens, types, [], specials, True, False, None, [],
                 {"lowercase": lowercase, "strip_accents": lowercase if strip is None else bool(strip),
                  "sep": sep, "cls": cls, "mask": ids["mask"], "type_count": type_vocab_size})


_BYTE = re.compile(r"^<0x[0-9A-F]{2}>$")
_SPACE = "\u2581"


def _sentencepiece_layout(spec: dict) -> bool:
    """Whether spaces become \u2581 with one prepended at the start, as llama.cpp's SentencePiece tokenizer does it:
    Llama 2's normaliser (Prepend, Replace) or a Metaspace pre-tokenizer that prepends at the first word."""
    norm, pre = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm] if norm else []
    kinds = [(n.get("type"), n.get("prepend") or n.get("content")) for n in steps]
    if kinds == [("Prepend", _SPACE), ("Replace", _SPACE)] and not pre:
        return True
    return not norm and pre.get("type") == "Metaspace" and pre.get("replacement") == _SPACE \
        and pre.get("prepend_scheme", "always") in ("first", "always") and not pre.get("split", False)


def read_sentencepiece(tok: Tokenizer, vocab_size: int, config_eos: list[int], where: str) -> Vocab:
    """llama.cpp's "llama" vocab of a byte-fallback BPE with SentencePiece's space handling; others refused."""
    spec = json.loads(tok.backend.to_str())
    model = spec.get("model", {})
    if not _sentencepiece_layout(spec):
        raise KilnError(f"{where}: a byte-fallback BPE whose normaliser / pre-tokenizer "
                        f"({json.dumps(spec.get('normalizer'))[:80]}, {json.dumps(spec.get('pre_tokenizer'))[:80]}) "
                        "is not SentencePiece's (spaces as \u2581, one prepended); llama.cpp's llama vocab would "
                        "split differently")
    if tok.vocab_size > vocab_size:
        raise KilnError(f"{where}: tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}")
    by_id = {i: t for t, i in tok.backend.get_vocab(with_added_tokens=True).items()}
    added = tok.backend.get_added_tokens_decoder()
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        rank.setdefault(m.replace(" ", ""), r)
    unk = model.get("unk_token")
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif _BYTE.match(t):
            tokens.append(t)
            types.append(gguf.TokenType.BYTE)
        elif t == unk:
            tokens.append(t)
            types.append(gguf.TokenType.UNKNOWN)
        elif i in added:
            tokens.append(t)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank[t]) if t in rank else 0.0)
    base = read_vocab(tok, vocab_size, config_eos, where, sentencepiece=True)
    base.model, base.pre, base.tokens, base.types, base.merges, base.scores = "llama", "default", tokens, types, [], scores
    return base


def write_vocab(w: gguf.GGUFWriter, v: Vocab) -> None:
    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    if v.merges:
        w.add_token_merges(v.merges)
    if v.scores is not None:
        w.add_token_scores(v.scores)
        w.add_add_space_prefix(True)
    if v.wordpiece is not None:
        wp = v.wordpiece
        w.add_bool("tokenizer.ggml.normalizer.lowercase", wp["lowercase"])
        w.add_bool("tokenizer.ggml.normalizer.strip_accents", wp["strip_accents"])
        w.add_sep_token_id(wp["sep"])
        w.add_uint32("tokenizer.ggml.cls_token_id", wp["cls"])
        if wp["mask"] is not None:
            w.add_mask_token_id(wp["mask"])
        w.add_add_sep_token(True)
        w.add_token_type_count(wp["type_count"])
    add = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "pad": w.add_pad_token_id,
           "unk": w.add_unk_token_id, "eot": w.add_eot_token_id}
    for role, i in v.specials.items():
        add[role](i)
    w.add_add_bos_token(v.add_bos)
    w.add_add_eos_token(v.add_eos)
    if v.chat_template:
        w.add_chat_template(v.chat_template)


# ---- chat formats kiln can translate for Ollama ------------------------------------------------------

@dataclass(frozen=True)
class ChatFormat:
    name: str
    render: Callable[[list[dict], bool], str]   # (messages, add_generation_prompt) -> text
    ollama_template: str
    end_of_turn: tuple[str, ...]


def _chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# Go template (Ollama): each message as ChatML, then the assistant's opening after the last non-assistant one
_CHATML_OLLAMA = (
    '{{- range $i, $_ := .Messages }}\n'
    '{{- $last := eq (len (slice $.Messages $i)) 1 -}}\n'
    '<|im_start|>{{ .Role }}\n'
    '{{ .Content }}<|im_end|>\n'
    '{{ if and $last (ne .Role "assistant") }}<|im_start|>assistant\n'
    '{{ end }}\n'
    '{{- end }}')

CHAT_FORMATS = (ChatFormat("ChatML", _chatml, _CHATML_OLLAMA, ("<|im_end|>",)),)

_PROBES = (
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}],
)


def chat_format(tok: Tokenizer) -> ChatFormat | None:
    """The known layout the tokenizer's chat template renders exactly like on every probe, or None."""
    try:
        tpl = tok.chat()
    except KilnError:
        return None
    for fmt in CHAT_FORMATS:
        try:
            same = all(tpl.render(p, add_generation_prompt=g) == fmt.render(p, g) for p in _PROBES for g in (True, False))
        except KilnError:
            same = False
        if same:
            return fmt
    return None


def modelfile(gguf_name: str, tok: Tokenizer, eos_texts: list[str], system: str | None) -> str:
    """An Ollama Modelfile: FROM the GGUF beside it, TEMPLATE where translated, a stop per end-of-turn token."""
    lines = [f"FROM ./{gguf_name}", ""]
    fmt = chat_format(tok) if tok.chat_template else None
    if fmt is not None:
        lines += [f"# chat template: {fmt.name} (kiln rendered the model's template on probe conversations and it "
                  f"matched this layout exactly; tool calls are not translated)",
                  f'TEMPLATE """{fmt.ollama_template}"""', ""]
    elif tok.chat_template:
        lines += ["# TEMPLATE not written: kiln could not translate this model's chat template (it matches no "
                  "layout kiln knows: " + ", ".join(f.name for f in CHAT_FORMATS) + "). The GGUF carries the "
                  "original Jinja template as tokenizer.chat_template; write a TEMPLATE by hand for Ollama.", ""]
    else:
        lines += ["# TEMPLATE not written: the model has no chat template.", ""]
    stops = list(dict.fromkeys([*(fmt.end_of_turn if fmt else ()), *eos_texts]))
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    if system:
        lines += ["", f'SYSTEM """{system}"""']
    return "\n".join(lines) + "\n"
