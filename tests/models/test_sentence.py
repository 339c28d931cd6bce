"""Sentence embeddings: pooling as sentence-transformers pools, its files read and written, and the real
all-MiniLM-L6-v2 exported by kiln loading in SentenceTransformer with kiln's embeddings."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.errors import KilnError
from kiln.models.sentence import MODES, Pooling, load_sentence_model, pool, sentence_model
from kiln.pipelines import embed

SENTENCES = ["A man is eating food.", "The central bank raised interest rates again.", "Paris",
             " ".join(["a long text that sentence-transformers truncates to its max_seq_length"] * 40)]


@pytest.mark.parametrize("mode", MODES)
def test_pooling_equals_sentence_transformers(mode):
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling as STPooling

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 5 + [1] * 2])  # right and left padding
    want = STPooling(16, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    torch.testing.assert_close(pool(hidden, mask, mode), want, rtol=0, atol=1e-12)
    # the control: padding counted in would change every mode's answer for the padded rows
    assert not torch.allclose(pool(hidden, torch.ones_like(mask), mode)[1:], want[1:])


def test_pooling_files_round_trip_and_refusals(tmp_path, minilm_dir):
    got = Pooling.read(minilm_dir)
    assert got == Pooling("mean", True, 256)
    Pooling("cls", False, 128).write(tmp_path, 32)
    assert Pooling.read(tmp_path) == Pooling("cls", False, 128)
    assert not (tmp_path / "2_Normalize").exists()
    assert Pooling.read(tmp_path / "nothing") is None
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": ["cls", "max"]}))
    with pytest.raises(KilnError, match=r"1_Pooling/config\.json: pooling modes \['cls', 'max'\]"):
        Pooling.read(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))  # the newer layout
    assert Pooling.read(tmp_path).mode == "mean"
    with pytest.raises(KilnError, match="pooling mode 'avg' is not one of"):
        Pooling("avg")


def test_real_minilm_export_loads_in_sentence_transformers(minilm_dir, tmp_path):
    from sentence_transformers import SentenceTransformer
    from typer.testing import CliRunner

    from kiln.cli.main import app

    r = CliRunner().invoke(app, ["export", str(minilm_dir), "--out", str(tmp_path / "st")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    ours = load_sentence_model(tmp_path / "st").embed(SENTENCES)
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert st.max_seq_length == 256
    theirs = st.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    assert ours.shape == (4, 384)
    torch.testing.assert_close(ours, theirs.cpu(), rtol=0, atol=1e-6)
    # and equal to the source directory read by sentence-transformers itself
    source = SentenceTransformer(str(minilm_dir), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(ours, source.cpu(), rtol=0, atol=1e-6)
    # the control: without the 256-token truncation the long text's embedding differs
    assert (load_sentence_model(tmp_path / "st").embed(SENTENCES[3:], max_length=512) - ours[3]).abs().max() > 1e-3


def write_tiny_decoder(d, texts: list[str]):
    """`d`: a tiny random Qwen3 base model written by transformers, a BPE tokenizer of `texts`, and
    sentence-transformers files for last-token pooling with normalisation."""
    from transformers import Qwen3Config, Qwen3Model

    from kiln.data.bpe import train_bpe

    d.mkdir(parents=True)
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts * 3))
    train_bpe([d / "corpus.jsonl"], d, vocab_size=300, min_frequency=1)
    (d / "corpus.jsonl").unlink()
    torch.manual_seed(0)
    Qwen3Model(Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                           pad_token_id=0)).save_pretrained(d)
    Pooling("lasttoken", True, 64).write(d, 32)
    return d


def test_decoder_last_token_pooling_equals_sentence_transformers(tmp_path):
    """A decoder (tiny Qwen3, transformers-written) with last-token pooling: kiln's embed() equals
    SentenceTransformer's on the same directory and on kiln's export of it, rows of several lengths."""
    from sentence_transformers import SentenceTransformer

    from kiln.interop.export import export_model

    texts = SENTENCES[:3] + ["short", "the bank and the food and the rates"]
    src = write_tiny_decoder(tmp_path / "src", texts)
    ours = load_sentence_model(src).embed(texts)
    assert torch.equal(embed(str(src), texts), ours)  # the one-call pipeline reads the directory's pooling
    theirs = SentenceTransformer(str(src), device="cpu").encode(texts, convert_to_tensor=True, batch_size=len(texts))
    # fp32 forward of the same operations; rows padded differently in a batch differ only by rounding
    torch.testing.assert_close(ours, theirs.cpu(), rtol=0, atol=1e-6)
    export_model(src, tmp_path / "out")
    again = SentenceTransformer(str(tmp_path / "out"), device="cpu").encode(texts, convert_to_tensor=True,
                                                                            batch_size=len(texts))
    torch.testing.assert_close(ours, again.cpu(), rtol=0, atol=1e-6)
    # the control: mean pooling of the same states is another embedding
    mean = sentence_model(load_sentence_model(src), Pooling("mean", True, 64)).embed(texts)
    assert (mean - ours).abs().max() > 1e-3


def test_sentence_model_saves_pooling_width_of_a_config_without_layer_count(tmp_path):
    """DistilBERT's config names its width `dim` (hidden_size a property) and its depth `n_layers`: the pooling
    files still get the embedding width, and a config with no width at all is refused by name."""
    from kiln.models.auto import from_config
    from kiln.models.common.config import config_size
    from kiln.models.distilbert import TINY, DistilBertConfig

    model = sentence_model(from_config(DistilBertConfig.from_dict(TINY.config), seed=0), Pooling("cls", False, 64))
    model.save_pretrained(tmp_path / "out", save_tokenizer=False)
    written = json.loads((tmp_path / "out" / "1_Pooling" / "config.json").read_text())
    assert written["word_embedding_dimension"] == TINY.config["dim"]
    with pytest.raises(KilnError, match="distilbert: the config has no num_hidden_layers"):
        config_size(model.config, "num_hidden_layers")
