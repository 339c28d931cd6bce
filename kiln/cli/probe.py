"""`kiln probe`: what this machine offers kiln (python, torch, devices, dtypes, backends, compile)."""

from __future__ import annotations

import platform

import typer
from rich.table import Table

from kiln.cli.output import out


def _compile_works() -> str:
    import torch

    try:
        fn = torch.compile(lambda x: x * 2 + 1, backend="inductor")
        ok = torch.equal(fn(torch.arange(4.0)), torch.arange(4.0) * 2 + 1)
        return "yes" if ok else "no (wrong result)"
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here"; say why
        return f"no ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"


def _fp8(device: str) -> str:
    """Whether FP8 matmuls run here, by running one tiny `torch._scaled_mm` (not by the device's name)."""
    import torch

    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        got = torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                               scale_b=torch.full((1, 16), 2.0, device=device), out_dtype=torch.float32)
        return "yes (_scaled_mm)" if bool(torch.all(got == 64.0)) else "no (_scaled_mm gave a wrong result)"
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here"; say why
        return f"no, emulated ({type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''})"


def probe(compile_check: bool = typer.Option(True, "--compile/--no-compile", help="Try torch.compile once.")) -> None:
    """Report Python, torch, accelerators (memory, bf16/fp8), distributed backends, torch.compile."""
    import torch
    import torch.distributed as dist

    table = Table(show_header=False, box=None)
    table.add_row("python", platform.python_version())
    table.add_row("torch", torch.__version__)
    table.add_row("cpu threads", str(torch.get_num_threads()))
    table.add_row("cpu fp8", _fp8("cpu"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cap = torch.cuda.get_device_capability(i)
            table.add_row(f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, capability {cap[0]}.{cap[1]}, "
                                       f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}, "
                                       f"fp8 {_fp8(f'cuda:{i}')}")
    else:
        table.add_row("cuda", "not available")
    mps = getattr(torch.backends, "mps", None)
    table.add_row("mps", "available" if mps is not None and mps.is_available() else "not available")
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]
    table.add_row("distributed", ", ".join(backends) or "none")
    if compile_check:
        table.add_row("torch.compile", _compile_works())
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("probe")(probe)
