"""What the kernel dialect hands to MLX (dsv4/kernels/dialect.py): sources compacted and
headers cut to what the body uses. CPU, runs in CI (the compile gates in test_metal_syntax.py
build every real kernel from the same text)."""

from dsv4.kernels import dialect

HEADER = r"""
#define TWICE(x) (2 * helper_a(x))   // a macro's calls count as uses
// helper_a: used through the macro only
KFN float helper_a(float x) { return x + 1.0f; }
/* helper_b: used by helper_c,
   which the body calls */
KFN float helper_b(float x) { return x * 3.0f; }
template <int N> KFN float helper_c(float x) { return helper_b(x) + N; }
KFN float unused_one(float x) { return x; }
template <int XS> struct Chunk { static KFN float get(float v) { return v; } };
template <> struct Chunk<0> { static KFN float get(float v) { return -v; } };
template <int XS> struct NeverUsed { int a; };
constexpr int TABLE[2] = {1, 2};
"""
BODY = r"""
  // the body
  out[0] = TWICE(helper_c<2>(x[0])) + Chunk<0>::get(x[1]) + TABLE[1];
"""


def test_header_keeps_what_the_body_uses_directly_or_not():
    kept = dialect.used_only(dialect.compact(HEADER), dialect.compact(BODY))
    for name in ("#define TWICE", "helper_a", "helper_b", "helper_c", "struct Chunk {", "struct Chunk<0>", "TABLE"):
        assert name in kept, name
    assert "unused_one" not in kept and "NeverUsed" not in kept
    assert kept.index("helper_a") < kept.index("helper_b") < kept.index("helper_c")   # order kept


def test_compact_drops_comments_indentation_and_blank_lines():
    text = dialect.compact(HEADER + BODY)
    assert "//" not in text and "/*" not in text and "\n\n" not in text
    assert all(line == line.strip() for line in text.splitlines())
    assert "#define TWICE(x) (2 * helper_a(x))" in text.splitlines()


def test_every_kernel_source_is_smaller_and_keeps_its_body():
    import importlib
    import pkgutil

    import dsv4.kernels as package
    kernels = [v for m in pkgutil.iter_modules(package.__path__)
               for v in vars(importlib.import_module(f"dsv4.kernels.{m.name}")).values()
               if isinstance(v, dialect.Kernel)]
    assert len(kernels) > 10
    for k in kernels:
        header, body = k.source("cuda")
        assert len(header) < len(dialect.CUDA_HEADER + k.header), k.name
        assert dialect.compact(k.body) in body, k.name
