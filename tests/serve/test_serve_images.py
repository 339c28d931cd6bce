"""Image content in chat requests (kiln.serve.images): the official `openai` client against a live `kiln serve` of a
tiny Qwen3.5 image-text model (a Gated DeltaNet layer and a gated attention layer, a one-block vision tower, a BPE
tokenizer with the vision tokens and Qwen3's chat template). The served greedy answer (tokens and log-probs, whole
and streamed) is the engine's for the prompt `kiln chat --image` builds from the same image file; another image
changes it; web and file addresses, bad data and a model without a vision tower are 400s naming the field."""

from __future__ import annotations

import base64
import json
from importlib import resources

import numpy as np
import openai
import pytest

from kiln.interop.tiny import TINY
from tests.serve.helpers import LiveServer

PIL = pytest.importorskip("PIL.Image")
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # ids 3, 4, 5 after the 3 chat tokens
VOCAB = 304
QUESTION = "what is in the picture?"
GREEDY = {"temperature": 0, "max_tokens": 6, "logprobs": True, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    """A saved tiny image-text model with its tokenizer, chat template and processor; two PNG pictures."""
    from kiln.data.bpe import train_bpe
    from kiln.data.images import QwenImageProcessor
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    d = tmp_path_factory.mktemp("serve-vision")
    (d / "text.txt").write_text(f"{QUESTION}\nuser assistant system\nthe cat sat on the mat 0 1 2 3\n")
    train_bpe([d / "text.txt"], d / "tok", vocab_size=300, min_frequency=1, extra_special_tokens=VISION_TOKENS)
    cfg = json.loads((d / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    # weights at std 0.1, so an image moves the log-probs well past rounding
    text = {**TINY["qwen3_5"]["text_config"], "vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 2,
            "max_position_embeddings": 256, "initializer_range": 0.1}
    config = AutoConfig.for_model("qwen3_5", **{**TINY["qwen3_5"], "text_config": text, "vision_start_token_id": 3,
                                                "image_token_id": 4, "vision_end_token_id": 5,
                                                "video_token_id": VOCAB - 1, "tie_word_embeddings": False})
    model = from_config(config, task="causal-lm", seed=0)
    model.tokenizer = Tokenizer.from_dir(d / "tok")
    model.save_pretrained(d / "model")
    processor = QwenImageProcessor(patch_size=4, merge_size=2, min_pixels=64)
    (d / "model" / "preprocessor_config.json").write_text(json.dumps(processor.to_dict()))
    rng = np.random.default_rng(0)
    for name, (h, w) in (("a.png", (24, 16)), ("b.png", (16, 16))):
        PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / name)
    return d


@pytest.fixture(scope="module")
def live_vision(vision_dir):
    from kiln.cli.serve import build_state

    server = LiveServer(build_state(vision_dir / "model", [], name="vl", max_tokens=64, max_queue=4))
    yield server
    server.stop()


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def ask(url: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def engine_greedy(model_dir, image) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, tokens, log-probs) of the engine's greedy answer to the prompt `kiln chat --image` builds."""
    from kiln.cli.common import load_for_prediction
    from kiln.data.sft import image_chat_prompt
    from kiln.engine import Engine, SamplingParams
    from kiln.models.tasks import CAUSAL_LM

    model = load_for_prediction(model_dir, CAUSAL_LM, False, False)
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": QUESTION}]}]
    ids, inputs = image_chat_prompt(model.tokenizer, messages, model.image_tokens(model_dir=model_dir))
    done = Engine(model, model.tokenizer).generate([ids], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True,
                                                                 ignore_eos=True),
                                                   [inputs])[0][0]
    return ids, done.token_ids, done.logprobs


def test_served_image_answer_is_the_engines(live_vision, vision_dir):
    client = live_vision.client()
    ids, tokens, logprobs = engine_greedy(vision_dir / "model", vision_dir / "a.png")
    assert ids.count(4) == 6  # the 16 x 24 picture: 4 x 6 patches, merged 2 x 2
    got = client.chat.completions.create(model="vl", messages=ask(data_url(vision_dir / "a.png")), **GREEDY)
    assert [t.logprob for t in got.choices[0].logprobs.content] == logprobs  # bit for bit
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(tokens) == 6
    tok = live_vision.state.models["vl"].tokenizer
    assert got.choices[0].message.content == tok.decode(tokens)
    streamed = client.chat.completions.create(model="vl", messages=ask(data_url(vision_dir / "a.png")), stream=True,
                                              **GREEDY)
    assert [t.logprob for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == logprobs
    # the control: another picture, same text, another answer
    other = client.chat.completions.create(model="vl", messages=ask(data_url(vision_dir / "b.png")), **GREEDY)
    assert [t.logprob for t in other.choices[0].logprobs.content] != logprobs
    assert other.usage.prompt_tokens == len(ids) - 2  # 16 x 16: 4 placeholders


def test_image_refusals_name_the_field(live_vision, vision_dir):
    client = live_vision.client()
    field = "messages.0.content.0.image_url.url"
    for url, says in (("https://example.com/cat.png", "reaches no network"), ("file:///etc/passwd", "file://"),
                      ("data:image/png;base64,@@@", "does not decode"),
                      ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image"),
                      ("ftp://host/x.png", "want a data:image")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="vl", messages=ask(url), max_tokens=2)
        assert e.value.status_code == 400 and e.value.param == field and says in e.value.message, (url, e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vl", messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}], max_tokens=2)
    assert e.value.status_code == 400 and e.value.param.startswith("messages.0.content.0"), e.value.param
    # the server still answers after the refusals (and text-only chats on the image-text model)
    assert client.chat.completions.create(model="vl", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=2).choices[0].message is not None


def test_a_model_without_a_vision_tower_refuses_images(live, vision_dir):
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model="tiny", messages=ask(data_url(vision_dir / "a.png")),
                                              max_tokens=2)
    assert e.value.status_code == 400 and e.value.param == "messages.0.content.0.image_url"
    assert "no vision tower" in e.value.message
