"""tools/launch_limits.py: every launch the kernel dispatchers make at V4.1's widths fits the
GPU's limits on Metal and on CUDA, and the check sees what overflows."""

import dataclasses

import mlx.core as mx
import pytest

from dsv4.kernels import matvec
from dsv4.kernels.dialect import Kernel
from tools import launch_limits as limits
from tools.metal_syntax_check import all_kernels



def test_every_v41_launch_fits_metal_and_cuda():
    assert limits.v41_problems() == []


@pytest.mark.parametrize("name", ["metal", "cuda"])
def test_the_v41_calls_launch_every_kernel(name):
    launched = {launch.kernel.name for launch in limits.record(name, limits.v41_calls)}
    assert {k.name for k in all_kernels() if name in k.dialects} - launched == set()


def test_metal_takes_the_reference_where_x_would_overflow_threadgroup_memory(monkeypatch):
    """wo_b's input (8192 values, 36992 bytes of padded fp32 copy) fits CUDA's 48 KB, not an
    Apple GPU's 32 KB: the matvec's dispatch must leave it to the reference on Metal; with the
    check it had (48 KB on every backend) the gate reports the launches (MLX packs and GGUF; as
    the integer units' limbs, 45184 bytes). Likewise the GGUF multi-token launch's segment of 6 tokens' limbs (the integer units):
    33792 bytes, which Metal must leave to the one-token launch."""
    metal = [launch for launch in limits.record("metal", limits.v41_calls) if launch.kernel is matvec.MATVEC_KERNEL]
    cuda = [launch for launch in limits.record("cuda", limits.v41_calls) if launch.kernel is matvec.MATVEC_KERNEL]
    assert max(dict(launch.template)["K"] for launch in metal) == 5120
    assert max(dict(launch.template)["K"] for launch in cuda) == 8192
    monkeypatch.setattr(matvec, "shared_memory_limit", lambda _: 48 * 1024)
    found = limits.v41_problems()
    assert {p.split(" ")[0] for p in found} == {"dsv4_quantized_matvec", "dsv4_gguf_matvec", "dsv4_gguf_matvec_tokens"}
    assert all("[metal]" in p for p in found)
    assert all("K=8192" in p and ("XS=9" in p and "36992 bytes" in p or "XS=11" in p and "45184 bytes" in p)
               and "of threadgroup memory, more than 32768" in p
               for p in found if not p.startswith("dsv4_gguf_matvec_tokens"))
    assert all("XS=11" in p and "TOKS=6" in p and "33792 bytes of threadgroup memory, more than 32768" in p
               for p in found if p.startswith("dsv4_gguf_matvec_tokens"))


def _kernel(body):
    return Kernel(name="probe", input_names=("x",), output_names=("y",), body=body)


def test_threadgroup_bytes_per_instantiation():
    body = """
      constexpr int RW = ROWS * 32 / LANES;   // a constant the sizes use
      SHARED float part[(K + HS) * RW];
      SHARED uint4 xs[D / 32 * XS];
      SHARED T row[3];
      SHARED_ATOMIC_U32 hist[256];
      SHARED uint32_t offs[2][32];
    """
    template = (("T", mx.bfloat16), ("ROWS", 2), ("LANES", 8), ("K", 6), ("HS", 1), ("D", 5120), ("XS", 9))
    part = (6 + 1) * 8 * 4                   # 224
    xs = 5120 // 32 * 9 * 16                 # 23040
    row = 16                                 # 3 bf16, rounded up to 16 bytes
    assert limits.threadgroup_bytes(_kernel(body), template) == part + xs + row + 256 * 4 + 2 * 32 * 4
    wider = dict(template, D=7168)
    assert limits.threadgroup_bytes(_kernel(body), tuple(wider.items())) == part + 7168 // 32 * 9 * 16 + row + 1024 + 256


def test_threadgroup_array_of_an_unknown_type_is_an_error():
    with pytest.raises(ValueError, match="unknown type"):
        limits.threadgroup_bytes(_kernel("SHARED mystery_t a[4];"), ())


def launch(body="SHARED float a[N];", n=1024, grid=(256, 4, 1), threadgroup=(256, 1, 1), dialect="metal"):
    return limits.Launch(_kernel(body), dialect, grid, threadgroup, (("N", n),))


def test_a_launch_within_the_limits_has_no_problem():
    assert limits.problems(launch(n=8192)) == []                        # 32 KB exactly
    assert limits.problems(launch(n=12288, dialect="cuda")) == []      # 48 KB on CUDA


@pytest.mark.parametrize("changed,message", [
    (dict(n=8193), "32784 bytes of threadgroup memory, more than 32768"),
    (dict(n=12289, dialect="cuda"), "49168 bytes of threadgroup memory, more than 49152"),
    (dict(grid=(2048, 1, 1), threadgroup=(2048, 1, 1)), "2048 threads per threadgroup, more than 1024"),
    (dict(grid=(480, 1, 1), threadgroup=(48, 1, 1)), "threadgroup (48, 1, 1) is not (32 k, 1, 1)"),
    (dict(grid=(64, 2, 1), threadgroup=(32, 2, 1)), "threadgroup (32, 2, 1) is not (32 k, 1, 1)"),
    (dict(grid=(300, 1, 1)), "grid (300, 1, 1) is not whole threadgroups of (256, 1, 1)"),
])
def test_each_limit_is_checked(changed, message):
    found = limits.problems(launch(**changed))
    assert len(found) == 1 and message in found[0], found


def test_a_mutated_kernel_body_that_overflows_fails_the_gate():
    """A body declaring one more 16 KB array than it has: its V4.1 launches are reported."""
    from dsv4.kernels import indexer

    grown = dataclasses.replace(indexer.SCORES_KERNEL, body="SHARED float extra[H * DK];\n" + indexer.SCORES_KERNEL.body)
    launches = [dataclasses.replace(l, kernel=grown) for l in limits.record("metal", limits.v41_calls)
                if l.kernel is indexer.SCORES_KERNEL]
    assert launches and all("32896 bytes of threadgroup memory, more than 32768" in " ".join(limits.problems(l)) for l in launches)
