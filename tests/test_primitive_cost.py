"""benchmarks/primitive_cost.py on the CPU: every kind it can build here is timed, and the report
holds one row a kind (the custom-kernel kinds need a GPU backend)."""

from benchmarks import primitive_cost


def test_each_kind_gets_its_three_parts(tmp_path):
    assert primitive_cost.main(["--chain", "4", "--repeats", "2", "--out", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("*-primitive-cost.md")
    table = report.read_text().split("| kind |")[1].split("\n\n")[0].splitlines()[2:]
    kinds = {cells[0].strip(): [float(v) for v in cells[1:]] for cells in (line.split("|")[1:-1] for line in table)}
    assert set(kinds) == {"add", "reshape (view)", "put_along_axis", "quantized_matmul", "compiled add x10 (one call)"}
    for name, (build, encode, wait, total) in kinds.items():
        assert build > 0 and encode > 0 and wait >= 0 and abs(total - (build + encode + wait)) < 0.02, name


def test_a_chain_is_what_it_says():
    step, first = primitive_cost.kinds()["add"]
    assert primitive_cost._repeat(step, first, 7).tolist() == [7.0] * 8
