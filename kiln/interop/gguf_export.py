"""Export a kiln model (HF directory, run checkpoint, LoRA or QLoRA run merged) as one GGUF file for llama.cpp.

The file is written by the `gguf` package's GGUFWriter (llama.cpp's own Python writer): metadata from
kiln.interop.gguf_arch (hyperparameters, tensor names) and kiln.interop.gguf_vocab (tokenizer, chat
template), tensors in the asked type. f32 / f16 / bf16 / q8_0 are the `gguf` package's conversions; the
K-quants are llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`) run over an f32 GGUF, optionally
with kiln's importance matrix (kiln.interop.gguf_imatrix). As llama.cpp's converter does, 1-D tensors (norms,
biases), the routers (the shared expert's gate too), rope factors and BERT's position / token-type embeddings (which
llama.cpp's CPU adds to f32 activations) stay f32, and a matrix whose rows do not split into the type's blocks falls
back to f16. An embedding encoder's file names its pooling (kiln.interop.gguf_encoder).

The file is written under a temporary name beside `out` and renamed when complete; an Ollama Modelfile
goes beside it.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from kiln.errors import KilnError
from kiln.hub.files import as_umask_allows, write_text_atomic
from kiln.interop.gguf_arch import GgufFamily, gguf_family, gguf_tensors
from kiln.interop.gguf_encoder import POOLING, pooling_problem
from kiln.interop.gguf_vocab import modelfile, read_vocab, read_wordpiece, write_vocab
from kiln.models.common.config import text_sizes
from kiln.models.pretrained import PreTrainedModel

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True)
class GgufType:
    qtype: Q | None        # what the gguf package writes matrices as; None: llama.cpp's quantizer
    file_type: FT


GGUF_TYPES: dict[str, GgufType] = {
    "f32": GgufType(Q.F32, FT.ALL_F32),
    "f16": GgufType(Q.F16, FT.MOSTLY_F16),
    "bf16": GgufType(Q.BF16, FT.MOSTLY_BF16),
    "q8_0": GgufType(Q.Q8_0, FT.MOSTLY_Q8_0),
    "q4_k_m": GgufType(None, FT.MOSTLY_Q4_K_M),
    "q5_k_m": GgufType(None, FT.MOSTLY_Q5_K_M),
    "q6_k": GgufType(None, FT.MOSTLY_Q6_K),
}
# kept in f32 whatever the type (llama.cpp's converter does the same): small, and precision-critical
_F32_TENSORS = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD,
                gguf.MODEL_TENSOR.TOKEN_TYPES, gguf.MODEL_TENSOR.ROPE_FREQS, gguf.MODEL_TENSOR.SSM_A,
                gguf.MODEL_TENSOR.SSM_D, gguf.MODEL_TENSOR.SSM_CONV1D)


def gguf_type(name: str) -> GgufType:
    if name not in GGUF_TYPES:
        raise KilnError(f"--gguf-type {name!r}: choose one of {', '.join(GGUF_TYPES)}")
    return GGUF_TYPES[name]


def eos_ids(config) -> list[int]:
    e = getattr(config, "eos_token_id", None)
    return [] if e is None else ([e] if isinstance(e, int) else list(e))


def pooling_mode(model: PreTrainedModel) -> str:
    """An embedding model's sentence-transformers pooling mode; mean where it has none (load_sentence_model's)."""
    pooling = getattr(model, "pooling", None)
    return "mean" if pooling is None else pooling.mode


def _plain_model(model: PreTrainedModel) -> PreTrainedModel:
    """A LoRA model merged into its base (a 4-bit QLoRA base dequantized first, as the HF export does)."""
    from kiln.models.common.quant4 import dequantize_bnb4_model, is_4bit

    if getattr(model, "lora_config", None) is None and not any(map(is_4bit, model.modules())):
        return model
    model = copy.deepcopy(model)
    if any(map(is_4bit, model.modules())):
        model = dequantize_bnb4_model(model, torch.float32)
    if getattr(model, "lora_config", None) is not None:
        from kiln.models.common.lora import merge_lora

        model = merge_lora(model)
    return model


def _tensor_type(kind: GgufType, tensor: gguf.MODEL_TENSOR | None, t: torch.Tensor) -> Q:
    if kind.qtype is None or t.dim() < 2 or kind.qtype == Q.F32 or tensor in _F32_TENSORS:
        return Q.F32
    block = gguf.GGML_QUANT_SIZES[kind.qtype][0]
    return kind.qtype if t.shape[-1] % block == 0 else Q.F16


def _encode(t: torch.Tensor, qtype: Q) -> np.ndarray:
    data = t.detach().to(torch.float32).cpu().numpy()
    return gguf.quants.quantize(data, qtype)


def write_gguf(model: PreTrainedModel, out: str | os.PathLike, type_name: str = "f16", name: str | None = None,
               system: str | None = None, modelfile_too: bool = True, imatrix_text: str | None = None) -> Path:
    """Write `model` to `out` (.gguf) in `type_name`; with `modelfile_too`, an Ollama Modelfile beside it; with
    `imatrix_text` (K-quants), llama.cpp's quantizer weighs each column by kiln's importance matrix on that text."""
    kind = gguf_type(type_name)
    if imatrix_text is not None and kind.qtype is not None:
        raise KilnError(f"--imatrix: an importance matrix steers llama.cpp's K-quants; --gguf-type {type_name} "
                        "does not use one")
    out = Path(out)
    if out.suffix != ".gguf":
        raise KilnError(f"--out {out}: a GGUF export is one file; name it *.gguf")
    if out.is_dir():
        raise KilnError(f"--out {out}: is a directory; name the .gguf file to write")
    config = model.config
    fam = gguf_family(config.model_type, config)
    tok = model.tokenizer
    if tok is None:
        raise KilnError(f"{name or 'the model'}: no tokenizer; llama.cpp needs the vocabulary in the GGUF")
    where = name or "the model"
    vocab_size = text_sizes(config).vocab_size
    if json.loads(tok.backend.to_str()).get("model", {}).get("type") == "WordPiece":
        vocab = read_wordpiece(tok, vocab_size, getattr(config, "type_vocab_size", 1), where)
    else:
        vocab = read_vocab(tok, vocab_size, eos_ids(config), where)
    if fam.encoder and pooling_problem(pooling_mode(model)):
        raise KilnError(f"--format gguf: {config.model_type}: {pooling_problem(pooling_mode(model))}")
    model = _plain_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        if kind.qtype is not None:
            _write(model, fam, vocab, tmp, kind, name)
        else:  # K-quants: llama.cpp's quantizer over an f32 file
            f32 = tmp + ".f32"
            try:
                _write(model, fam, vocab, f32, GGUF_TYPES["f32"], name)
                imatrix = None
                if imatrix_text is not None:
                    from kiln.interop.gguf_imatrix import importance

                    imatrix = importance(model, fam, imatrix_text)
                llama_quantize(f32, tmp, kind.file_type, imatrix=imatrix)
            finally:
                if os.path.exists(f32):
                    os.remove(f32)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        as_umask_allows(Path(tmp))  # mkstemp's 0600 would hide the file from an Ollama service's user  # sweep
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if modelfile_too:
        eos_texts = [tok.id_to_token(i) for i in eos_ids(config) if tok.id_to_token(i)]
        if "eos" in vocab.specials:
            eos_texts.append(tok.id_to_token(vocab.specials["eos"]))
        text = modelfile(out.name, tok, [t for t in eos_texts if t], system)
        write_text_atomic(out.with_name("Modelfile"), text)
    return out


def _write(model: PreTrainedModel, fam: GgufFamily, vocab, path: str, kind: GgufType, name: str | None) -> None:
    config = model.config
    w = gguf.GGUFWriter(path, fam.name)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or config.model_type)
    w.add_file_type(kind.file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fam.hparams(w, config)
    if fam.encoder:
        w.add_pooling_type(POOLING[pooling_mode(model)])
    write_vocab(w, vocab)
    with torch.no_grad():
        for gname, tensor, t in gguf_tensors(fam, config, model.hf_state_dict()):
            if not t.is_floating_point():  # an index table (DeepSeek-V4's tid2eid): int32 as llama.cpp reads it
                w.add_tensor(gname, t.to(torch.int32).cpu().numpy())
                continue
            qtype = _tensor_type(kind, tensor, t)
            w.add_tensor(gname, _encode(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_quantize(src: str, dst: str, file_type: FT, threads: int | None = None,
                   imatrix: dict[str, np.ndarray] | None = None) -> None:
    """llama.cpp's own quantizer (through llama-cpp-python) from `src` to `dst`, with an importance matrix
    (GGUF tensor name -> per-column weights, kiln.interop.gguf_imatrix) when given."""
    try:
        import llama_cpp
    except ImportError:
        raise KilnError("--gguf-type with a K-quant needs llama.cpp's quantizer: pip install 'kiln[gguf]' "
                        "(llama-cpp-python)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(file_type)
    params.nthread = threads or 1
    held = None
    if imatrix is not None:
        from kiln.interop.gguf_imatrix import ImatrixArray

        held = ImatrixArray(imatrix)  # alive until the quantizer returns
        params.imatrix = ctypes.cast(held.entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # llama.cpp prints every tensor it converts
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise KilnError(f"llama.cpp's quantizer failed on {src} ({file_type.name}, return code {rc})")
    del held
