"""How often a load reads each weight file's header and resolves its path, and which kiln modules it passes through.

Not a speed benchmark: counts, for the loading note (issue 44, "one loading path"). Tiny checkpoints (built here in a
temporary directory) of each kind a load takes: safetensors in several files with an index, PyTorch `.bin` shards, a
block-scaled FP8 release, a plain one quantized to NF4 at load, and a DeepSeek-V4-Flash look-alike release with its
FP8 / FP4 MTP layer (carried by reference). Each is loaded three ways: the whole load (`load_pretrained`), the
sharded load in one process as the Trainer runs it (`lean_pretrained`, then `read_shards`), and `kiln plan`'s look
(`read_plan`).

A header read is one parse of a file's header: a `safe_open` of a safetensors file (the library parses its JSON
header), a JSON parse of that header by kiln itself, or a `.bin` file's pickle read onto the meta device (no tensor
data). A path resolution is one `resolve_model_dir` call. Counted by wrapping those names wherever kiln imported them.

Modules passed through: every call from one kiln module into another (kiln.errors aside) during the sharded load,
at most two calls below its entry points, as the sequence of modules entered; "returns" counts the entries into a
module the sequence had already left.

    PYTHONPATH=$PWD python benchmarks/bench_load_reads.py [--depth 2]

Run by hand (not in `make bench`): it counts reads and module crossings for the loading note; it has no peer and
no ratio.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import safetensors
import torch

import kiln

KILN_DIR = Path(kiln.__file__).resolve().parent


class Counter:
    """Counts header parses per file and path resolutions, by wrapping the names in every loaded kiln module."""

    def __init__(self) -> None:
        self.headers: collections.Counter[str] = collections.Counter()
        self.resolves = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap_everywhere(self, original: Any, make: Callable[[Any], Any]) -> None:
        wrapped = make(original)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("kiln") or mod is safetensors:
                for attr, value in list(vars(mod).items()):
                    if value is original:
                        self._undo.append((mod, attr, value))
                        setattr(mod, attr, wrapped)

    def __enter__(self) -> Counter:
        import kiln.hub.pickled as pickled
        import kiln.hub.resolve as resolve

        counter = self

        def safe_open_wrapper(orig):
            def safe_open(path, *a, **k):
                counter.headers[Path(path).name] += 1
                return orig(path, *a, **k)
            return safe_open

        def load_bin_wrapper(orig):
            def load_bin(path, map_location="cpu"):  # the pickle is parsed: onto meta, or with the data
                counter.headers[Path(path).name] += 1
                return orig(path, map_location)
            return load_bin

        def resolve_wrapper(orig):
            def resolve_model_dir(*a, **k):
                counter.resolves += 1
                return orig(*a, **k)
            return resolve_model_dir

        class CountingJson:
            """`json` for the header readers: a loads of bytes read from a weights file is a header parse."""

            def __getattr__(self, name):
                return getattr(json, name)

            @staticmethod
            def loads(raw, *a, **k):
                path = sys._getframe(1).f_locals.get("path")  # the header readers' argument
                counter.headers[Path(str(path)).name] += 1
                return json.loads(raw, *a, **k)

        self._wrap_everywhere(safetensors.safe_open, safe_open_wrapper)
        self._wrap_everywhere(pickled.load_bin, load_bin_wrapper)
        self._wrap_everywhere(resolve.resolve_model_dir, resolve_wrapper)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("kiln.hub") and getattr(mod, "json", None) is json:
                self._undo.append((mod, "json", json))
                mod.json = CountingJson()
        return self

    def __exit__(self, *exc) -> None:
        for mod, attr, value in reversed(self._undo):
            setattr(mod, attr, value)


class ModuleTrace:
    """The kiln modules a load enters: each call from one kiln module into another, at most `depth` module changes
    below the entry points, counted once per (calling function, called function): a loop over the tensors that
    makes the same call again does not count again. `summary` gives the modules and the rooms (kiln's packages)."""

    def __init__(self, entries: set[str], depth: int = 2) -> None:
        self.entries, self.depth = entries, depth
        self.seq: list[str] = []
        self._edges: set[tuple[Any, Any]] = set()

    @staticmethod
    def _mod(frame) -> str | None:
        if frame is None:
            return None
        try:
            rel = Path(frame.f_code.co_filename).resolve().relative_to(KILN_DIR)
        except ValueError:
            return None
        name = ".".join(rel.with_suffix("").parts)
        return None if name in ("errors", "constants") else name

    def __enter__(self) -> ModuleTrace:
        depth_of: dict[int, int] = {}

        def prof(frame, event, arg):
            if event != "call":
                return
            mod = self._mod(frame)
            if mod is None:
                return
            caller = frame.f_back
            c = caller
            while c is not None and id(c) not in depth_of:
                c = c.f_back
            if c is None:
                if frame.f_code.co_name not in self.entries:
                    return
                d = 0
            else:
                d = depth_of[id(c)] + (mod != self._mod(caller))
            if d > self.depth:
                return
            depth_of[id(frame)] = d
            edge = (caller.f_code if caller is not None else None, frame.f_code)
            if mod != self._mod(caller) and edge not in self._edges:
                self._edges.add(edge)
                if not self.seq or self.seq[-1] != mod:
                    self.seq.append(mod)

        sys.setprofile(prof)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    @staticmethod
    def _returns(seq: list[str]) -> tuple[int, int, list[str]]:
        collapsed = [m for i, m in enumerate(seq) if i == 0 or seq[i - 1] != m]
        seen: set[str] = set()
        back = 0
        for m in collapsed:
            back += m in seen
            seen.add(m)
        return len(seen), back, collapsed

    def summary(self) -> str:
        n, back, _ = self._returns(self.seq)
        rooms, rback, rseq = self._returns([m.split(".")[0] for m in self.seq])
        return (f"{n} modules, {back} returns to one it left; {rooms} rooms (packages), {rback} returns: "
                f"{' > '.join(rseq)}\n    modules: {' > '.join(self.seq)}")


def build(root: Path) -> dict[str, tuple[Path, dict]]:
    from kiln.interop.tiny import make_tiny
    from kiln.models.auto import AutoConfig, from_config
    from tests.models.fp8_cases import make_fp8
    from tests.models.v4_release import make_release
    from tests.parallel import sharded_load_workers as sw

    size = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = from_config(AutoConfig.for_model("qwen3", **size), task="causal-lm", seed=0)
    st = model.to(torch.bfloat16).save_pretrained(root / "safetensors", max_shard_bytes=8_000)
    tiny = make_tiny("qwen3", "causal-lm", root / "tiny-qwen3", seed=0, intermediate_size=48)
    v4src = make_tiny("deepseek_v4", "causal-lm", root / "tiny-v4", seed=0, hidden_size=64, moe_intermediate_size=32,
                      mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=256,
                      compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    return {
        "safetensors, 4 files + index": (st, {}),
        ".bin, shards + index": (sw.bin_release(tiny, root / "bin", 8_000), {}),
        "FP8 release (dequantize)": (make_fp8(tiny, root / "fp8", "Qwen3ForCausalLM"), {}),
        "NF4 at load": (st, {"quantize": "nf4"}),
        "V4 release + FP8/FP4 MTP (keep)": (make_release(v4src, root / "v4" / "flash"), {"fp8": "keep"}),
    }


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=2, help="module changes below the entry points that count (a deeper "
                    "call chain in one tree hides modules the other shows: compare trees at a depth both reach)")
    depth = ap.parse_args().depth
    torch.manual_seed(0)
    from kiln.models.auto import load_pretrained
    from kiln.parallel.sharded_load import lean_pretrained, read_plan, read_shards

    with tempfile.TemporaryDirectory(prefix="kiln-load-reads-") as tmp:
        cases = build(Path(tmp))
        for name, (path, kw) in cases.items():
            files = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
            with Counter() as whole:
                load_pretrained(path, task="causal-lm", **kw)
            with Counter() as lean, ModuleTrace({"lean_pretrained", "read_shards"}, depth) as trace:
                model = lean_pretrained(path, "causal-lm", None, **kw)
                if model is not None:
                    read_shards(model, path)
            with Counter() as plan:
                read_plan(path, "causal-lm", kw.get("fp8", "dequantize"), kw.get("quantize"))
            print(f"== {name}: {len(files)} weight file(s)")
            for what, c in (("whole load", whole), ("sharded load (1 process)", lean), ("kiln plan", plan)):
                per = sorted({c.headers[f] for f in files})
                print(f"  {what}: header reads per file {per} (total {sum(c.headers[f] for f in files)}), "
                      f"path resolutions {c.resolves}")
            print(f"  sharded load: {'whole load taken' if model is None else trace.summary()}")


if __name__ == "__main__":
    main()
