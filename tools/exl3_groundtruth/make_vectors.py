"""Ground-truth EXL3 test vectors from exllamav3 itself, made on a CUDA machine.

Usage (on the GPU machine, from the repository root; see run.sh):
    python3 tools/exl3_groundtruth/make_vectors.py SRC OUT

SRC is an exllamav3 source tree (the folder that holds `exllamav3/`). Only its
`quant/reconstruct.cu` is compiled (JIT, with binding.cpp beside this file); exllamav3's own
Python then builds the full weight (`LinearEXL3.get_weight_tensor`). For every codebook and
K = 1..8 it decodes a random 128x128 EXL3 tensor, plus one 256x256 tensor per codebook, and
writes OUT/exl3_<codebook>.npz holding, per case `<name>_`: trellis, suh, svh, the inputs;
w_hat (`reconstruct`), w_fused (`reconstruct_had_slice`), w_torch (`get_weight_tensor`),
the outputs, all [in, out]. It also times the kernels on one 5120x2304 expert matrix.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from torch.utils.cpp_extension import load

CODEBOOKS = ("3inst", "mcg", "mul1")
MARKERS = {"3inst": {}, "mcg": {"mcg": -877912083}, "mul1": {"mul1": -2082680531}}


class _MissingModule(types.ModuleType):
    """Stands in for a third-party package the reconstruction path imports but never uses."""

    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (Exception,), {})


def build_extension(src: Path):
    ext_dir = src / "exllamav3" / "exllamav3_ext"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    t0 = time.time()
    ext = load(
        name="exllamav3_ext",
        sources=[str(Path(__file__).with_name("binding.cpp")), str(ext_dir / "quant" / "reconstruct.cu")],
        extra_include_paths=[str(ext_dir)],
        extra_cuda_cflags=["-O3", "-lineinfo", "-std=c++17"],
        extra_cflags=["-O3", "-std=c++17"],
        verbose=False,
    )
    sys.modules["exllamav3_ext"] = ext  # exllamav3/ext.py takes a loaded extension as precompiled
    print(f"built reconstruct extension in {time.time() - t0:.1f} s", flush=True)
    return ext


def import_linear_exl3(src: Path):
    """exllamav3.modules.quant.exl3.LinearEXL3, without running the package __init__ files
    (they import the whole inference stack)."""
    sys.path.insert(0, str(src))
    for pkg in ("exllamav3", "exllamav3.modules", "exllamav3.modules.quant", "exllamav3.model"):
        module = types.ModuleType(pkg)
        module.__path__ = [str(src.joinpath(*pkg.split(".")))]
        sys.modules[pkg] = module
    for _ in range(30):
        try:
            return importlib.import_module("exllamav3.modules.quant.exl3").LinearEXL3
        except ModuleNotFoundError as e:
            if e.name is None or e.name.startswith("exllamav3"):
                raise
            print(f"stubbing missing module {e.name}", flush=True)
            sys.modules[e.name] = _MissingModule(e.name)
    raise RuntimeError("could not import exllamav3.modules.quant.exl3")


def weight_via_exllamav3(LinearEXL3, trellis, suh, svh, codebook):
    # get_weight_tensor needs only these attributes; __init__ would also build the fused
    # inference object, which this tool does not compile
    lin = LinearEXL3.__new__(LinearEXL3)
    lin.su = lin.sv = None
    lin.suh, lin.svh, lin.trellis = suh, svh, trellis
    lin.K = trellis.shape[-1] // 16
    lin.in_features, lin.out_features = suh.numel(), svh.numel()
    lin.mcg, lin.mul1 = codebook == "mcg", codebook == "mul1"
    return lin.get_weight_tensor()


def decode_case(ext, LinearEXL3, rng, k_bits, codebook, k, n):
    trellis_np = rng.integers(-32768, 32768, size=(k // 16, n // 16, 16 * k_bits), dtype=np.int16)
    # suh/svh as exllamav3 makes them: random signs times per-channel scales
    suh_np = (rng.choice([-1.0, 1.0], k) * rng.uniform(0.02, 0.2, k)).astype(np.float16)
    svh_np = (rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.5, n)).astype(np.float16)
    trellis = torch.from_numpy(trellis_np).cuda()
    suh, svh = torch.from_numpy(suh_np).cuda(), torch.from_numpy(svh_np).cuda()
    mcg, mul1 = codebook == "mcg", codebook == "mul1"
    w_hat = torch.full((k, n), float("nan"), dtype=torch.half, device="cuda")
    ext.reconstruct(w_hat, trellis, k_bits, mcg, mul1)
    w_fused = torch.full((k, n), float("nan"), dtype=torch.half, device="cuda")
    ext.reconstruct_had_slice(w_fused, trellis, suh, svh, k_bits, mcg, mul1, 0)
    w_torch = weight_via_exllamav3(LinearEXL3, trellis, suh, svh, codebook)
    torch.cuda.synchronize()
    return {"trellis": trellis_np, "suh": suh_np, "svh": svh_np,
            "w_hat": w_hat.cpu().numpy(), "w_fused": w_fused.cpu().numpy(),
            "w_torch": w_torch.cpu().numpy()}


def time_expert(ext, LinearEXL3, k_bits=2, codebook="mcg", k=5120, n=2304, reps=20):
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * k_bits), dtype=torch.int16,
                            device="cuda")
    suh = torch.ones(k, dtype=torch.half, device="cuda")
    svh = torch.ones(n, dtype=torch.half, device="cuda")
    w = torch.empty((k, n), dtype=torch.half, device="cuda")
    mcg, mul1 = codebook == "mcg", codebook == "mul1"
    runs = {
        "reconstruct": lambda: ext.reconstruct(w, trellis, k_bits, mcg, mul1),
        "reconstruct_had_slice": lambda: ext.reconstruct_had_slice(w, trellis, suh, svh, k_bits,
                                                                   mcg, mul1, 0),
        "get_weight_tensor": lambda: weight_via_exllamav3(LinearEXL3, trellis, suh, svh, codebook),
    }
    out = {}
    for name, fn in runs.items():
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out[name] = start.elapsed_time(end) / reps / 1000
    return {"shape_in_out": [k, n], "K": k_bits, "codebook": codebook, "seconds": out}


def main(src: str, out: str) -> None:
    src_path, out_path = Path(src), Path(out)
    ext = build_extension(src_path)
    LinearEXL3 = import_linear_exl3(src_path)
    for index, codebook in enumerate(CODEBOOKS):
        rng = np.random.default_rng(20261129 + index)
        arrays = {}
        cases = [(f"K{k}", k, 128, 128) for k in range(1, 9)] + [("big", 2 + index, 256, 256)]
        for name, k_bits, k, n in cases:
            case = decode_case(ext, LinearEXL3, rng, k_bits, codebook, k, n)
            arrays.update({f"{name}_{key}": value for key, value in case.items()})
        np.savez_compressed(out_path / f"exl3_{codebook}.npz", **arrays)
        print(f"{codebook}: {len(cases)} cases written", flush=True)
    info = {
        "exllamav3_version": (src_path / "exllamav3" / "version.py").read_text().strip()
        if (src_path / "exllamav3" / "version.py").exists() else "unknown",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(), "timing": time_expert(ext, LinearEXL3),
    }
    (out_path / "exl3_groundtruth_info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
