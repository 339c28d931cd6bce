"""The bad cases of the third fault sweep (issue 41's "fresh sweep of your own"), each fixed as a class and held
here through the CLI where the user meets it: the exit code, the message naming the thing, no traceback, and
nothing under the case's folder changed. Before: a checkpoint write that hit a full disk or a file-size limit said
only "a .safetensors file could not be read or written" and left `.ckpt-N.tmp` behind; `kiln chat` fed a line
that is not UTF-8 died with a TypeError traceback (exit 70); a JSONL or JSON file saved "UTF-8 with BOM" was
refused as "not valid JSON"; a config.json that is a symbolic link in a loop was "no config.json in this
directory"; `--temperature inf` was told it "must be >= 0"; `--set train.steps=abc` was told to "drop the
quotes" it never had; `kiln generate -n 100000` stopped at the model's last position without a word."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from kiln.hub.jsonio import iter_jsonl, read_json
from tests.cli.reliability_world import pretrain_config, raw_shards, run_cli, snapshot
from tests.kiln_cli import REPO


def test_a_checkpoint_write_that_hits_a_file_size_limit_is_named_and_poisons_nothing(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: the same failed write(). The run runs from a copy of the package
    with no bytecode cache yet, as a fresh checkout does: CPython would write .pyc files cut short by the limit,
    and every later kiln command would die importing them; kiln writes none under a finite limit."""
    import marshal
    import shutil

    code_dir = tmp_path / "code"
    shutil.copytree(REPO / "kiln", code_dir / "kiln", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    inputs = tmp_path / "in"
    tok = raw_shards(inputs / "tok", 1)
    cfg = pretrain_config(inputs / "r.toml", tok, tmp_path / "out", train={"save_every": 1})
    before = snapshot(inputs)

    def limit() -> None:  # weights of the tiny model are ~50 KB: the first checkpoint cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    def train(out_dir, preexec=None) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "train", "--config", str(cfg), "--set",
                               f"train.out_dir={out_dir}"], capture_output=True, text=True, cwd=code_dir,
                              preexec_fn=preexec, timeout=300,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(code_dir), "OMP_NUM_THREADS": "1",
                                   "HF_HUB_OFFLINE": "1"})
        return proc.returncode, " ".join((proc.stdout + proc.stderr).split())

    code, out = train(tmp_path / "out", limit)
    assert code == 1 and "Traceback" not in out, out
    assert f"{tmp_path / 'out'}: writing checkpoint ckpt-000001 failed" in out, out
    assert "a file-size limit: ulimit -f" in out and "no checkpoint was complete yet: start the run again" in out, out
    assert snapshot(inputs) == before
    assert not list((tmp_path / "out").glob(".ckpt-*")) and not list((tmp_path / "out").glob("ckpt-*"))
    for pyc in code_dir.rglob("*.pyc"):  # none written; any there must load
        marshal.loads(pyc.read_bytes()[16:])
    code, out = train(tmp_path / "out2")  # the next command, without the limit, is not poisoned
    assert code == 0 and "done: step 2" in out, out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen3 with a ChatML byte-level BPE tokenizer and 64 positions."""
    import shutil

    from kiln.data.bpe import train_bpe
    from kiln.interop.tiny import make_tiny

    d = tmp_path_factory.mktemp("chat")
    (d / "text.txt").write_text("hello there\nhow are you today\nthe cat sat on the mat\n" * 10)
    train_bpe([d / "text.txt"], d / "tok", vocab_size=300, min_frequency=1)
    model = make_tiny("qwen3", "causal-lm", d / "model", tokenizer=False, vocab_size=300, eos_token_id=2,
                      pad_token_id=0, max_position_embeddings=64)
    for f in (d / "tok").iterdir():
        shutil.copy(f, model / f.name)
    return model


def test_a_chat_line_that_is_not_utf8_is_named_and_the_chat_goes_on(chat_model):
    model = chat_model
    before = snapshot(model)
    code, out = run_cli_input(b"hi\n\xff\xfe bytes\nhello\n\n", "chat", model, "--max-new-tokens", "2")
    assert code == 0 and "Traceback" not in out, out
    assert "error: that line is not UTF-8 text (byte 0xff at column 1); nothing was sent, type it again" in out
    assert out.count("bot>") == 2, out  # both good lines were answered
    assert snapshot(model) == before


def run_cli_input(stdin: bytes, *args) -> tuple[int, str]:
    """(exit code, output) of the CLI in a fresh process reading `stdin` (a real stdin: bytes, not a str)."""
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)], input=stdin,
                          capture_output=True, cwd=REPO, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                               "HF_HUB_OFFLINE": "1", "LANG": "C.UTF-8"})
    return proc.returncode, " ".join((proc.stdout + proc.stderr).decode("utf-8", "replace").split())


def test_json_and_jsonl_saved_with_a_bom_are_read(tmp_path):
    rows = [{"text": "a"}, {"text": "b"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8-sig")
    (tmp_path / "c.json").write_text(json.dumps({"k": 1}), encoding="utf-8-sig")
    before = snapshot(tmp_path)
    assert [v for _, v, _ in iter_jsonl(tmp_path / "d.jsonl")] == rows
    assert read_json(tmp_path / "c.json", want=dict) == {"k": 1}
    # a BOM on a later line is no BOM of the file: that line is still not JSON, and said so
    (tmp_path / "late.jsonl").write_bytes(b'{"text": "a"}\n\xef\xbb\xbf{"text": "b"}\n')
    with pytest.raises(Exception, match=r"late.jsonl:2: not valid JSON"):
        list(iter_jsonl(tmp_path / "late.jsonl"))
    assert snapshot(tmp_path) == {**before, "late.jsonl": snapshot(tmp_path)["late.jsonl"]}


def test_kiln_tokenize_reads_a_jsonl_saved_with_a_bom(tmp_path):
    from tests.data.tokdata import make_tokenizer_dir

    tok = make_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"the cat sat {i}"}) + "\n" for i in range(6)),
                                         encoding="utf-8-sig")
    before = snapshot(tmp_path)
    code, out = run_cli("tokenize", tmp_path / "docs.jsonl", "--tokenizer", tok, "--out", tmp_path / "out",
                        "--no-progress")
    assert code == 0 and "Traceback" not in out, out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] == 6, manifest
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("out")} == before


def test_a_config_json_in_a_symlink_loop_is_named_as_a_loop(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").symlink_to("config.json")
    before = snapshot(tmp_path)
    code, out = run_cli("inspect", tmp_path / "m")
    assert code == 1 and "Traceback" not in out, out
    assert f"{tmp_path / 'm' / 'config.json'}: is a symbolic link in a loop (to config.json" in out, out
    assert "no config.json in this directory" not in out
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag,value,says", [("--temperature", "inf", "--temperature must be a finite number >= 0, "
                                                                      "got inf"),
                                             ("--top-p", "nan", "--top-p must be a finite number > 0 and <= 1, "
                                                                "got nan"),
                                             ("--temperature", "-1", "--temperature must be >= 0, got -1")])
def test_a_non_finite_sampling_flag_is_told_it_must_be_finite(tmp_path, flag, value, says):
    code, out = run_cli("generate", tmp_path / "no-model", "hi", flag, value)  # checked before any load
    assert code == 1 and says in out and "Traceback" not in out, out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value,says", [("abc", "got 'abc'"), ("'12'", "got '12' (drop the quotes)")])
def test_text_where_a_number_belongs_is_told_to_drop_quotes_only_when_it_is_a_number(tmp_path, value, says):
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "r.toml", tok, tmp_path / "out")
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg, "--set", f"train.steps={value}")
    assert code == 1 and f"train.steps: Input should be a valid number, not text: {says}" in out, out
    assert ("drop the quotes" in out) == ("drop" in says)
    assert snapshot(tmp_path) == before


def test_generate_past_the_last_position_says_where_it_stops(chat_model):
    model, positions = chat_model, 64
    code, out = run_cli("generate", model, "hi", "-n", positions + 50)
    assert code == 0, out
    assert f"note: --max-new-tokens {positions + 50}: the model reads {positions} positions in all" in out, out
    code, out = run_cli("generate", model, "hi", "-n", "3")
    assert code == 0 and "note:" not in out, out


def test_a_gguf_file_is_readable_as_the_umask_allows(tmp_path, chat_model):
    """mkstemp made the .gguf 0600: an Ollama service running as its own user could not read the file kiln
    wrote a Modelfile for."""
    import os

    old = os.umask(0o022)
    try:
        code, out = run_cli("export", chat_model, "--out", tmp_path / "m.gguf",
                            "--format", "gguf")
    finally:
        os.umask(old)
    assert code == 0, out
    assert (tmp_path / "m.gguf").stat().st_mode & 0o777 == 0o644


def test_an_export_cut_short_by_a_file_size_limit_says_so_and_leaves_nothing(tmp_path, tiny_factory):
    src = tiny_factory("qwen3", "causal-lm")
    before = snapshot(src)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "export", str(src), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=REPO, preexec_fn=limit, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                               "HF_HUB_OFFLINE": "1"})
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert "(os error 27); a file-size limit (ulimit -f) or the filesystem's largest file stopped it" in out, out
    assert list(tmp_path.iterdir()) == [] and snapshot(src) == before


def test_an_unknown_chat_role_names_the_data_file_and_line(tmp_path, chat_model):
    """Issue 41's "an unknown chat role refused without the data file and line": the message named only the
    tokenizer's template."""
    from tests.cli.bad_inputs_world import write_toml

    good = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"}]}
    bad = {"messages": [{"role": "wizard", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good] * 9 + [bad]))
    cfg = write_toml(tmp_path / "r.toml", {
        "model": {"path": chat_model, "task": "causal-lm"},
        "data": {"train": tmp_path / "chat.jsonl", "max_length": 32},
        "train": {"out_dir": tmp_path / "out", "steps": 1, "batch_size": 2, "progress": False, "device": "cpu"}})
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "Traceback" not in out, out
    assert f"{tmp_path / 'chat.jsonl'}:10: " in out and "unknown role wizard" in out, out
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_plan_on_the_cpu_with_too_many_processes_does_not_advise_more(tmp_path, chat_model):
    """Issue 41's `kiln plan --nproc 10000` on CPU advised "more processes": on one host they share its memory."""
    from tests.cli.bad_inputs_world import write_toml

    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "yo"}]}) + "\n")
    cfg = write_toml(tmp_path / "r.toml", {
        "model": {"path": chat_model, "task": "causal-lm"},
        "data": {"train": tmp_path / "chat.jsonl", "max_length": 32},
        "train": {"out_dir": tmp_path / "out", "steps": 1, "batch_size": 2, "device": "cpu"}})
    before = snapshot(tmp_path)
    code, out = run_cli("plan", "--config", cfg, "--nproc", "10000")
    assert code == 1 and "Traceback" not in out, out
    assert "fits: fewer processes (they share the host's memory)" in out and "more processes" not in out, out
    assert snapshot(tmp_path) == before


def test_a_checkpoint_or_run_directory_given_as_a_model_names_the_model_inside(tmp_path):
    (tmp_path / "run" / "ckpt-000004" / "model").mkdir(parents=True)
    (tmp_path / "run" / "ckpt-000004" / "model" / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    code, out = run_cli("generate", tmp_path / "run" / "ckpt-000004", "hi")
    assert code == 1 and "Traceback" not in out, out
    assert f"it is a run checkpoint: its model directory is {tmp_path / 'run' / 'ckpt-000004' / 'model'}" in out, out
    code, out = run_cli("inspect", tmp_path / "run")
    assert code == 1 and f"its newest checkpoint's model is {tmp_path / 'run' / 'ckpt-000004' / 'model'}" in out, out
    code, out = run_cli("inspect", tmp_path)
    assert code == 1 and "no config.json in this directory; is it an HF model directory?" in out, out
    assert snapshot(tmp_path) == before
