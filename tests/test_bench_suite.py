"""`make bench` stays out of `make test`: the test target runs tests/ without the bench marker, the benchmarks live in
bench/ and carry the marker."""

import re

from .conftest import ROOT


def test_bench_is_not_part_of_make_test():
    mk = (ROOT / "Makefile").read_text()
    test_recipe = re.search(r"^test:.*\n\t(.*)$", mk, re.M).group(1)
    assert '-m "not bench"' in test_recipe and test_recipe.rstrip().endswith(" tests")
    bench_recipe = re.search(r"^bench:.*\n\t(.*)$", mk, re.M).group(1)
    assert "-m bench bench" in bench_recipe
    assert "pytestmark = pytest.mark.bench" in (ROOT / "bench" / "test_bench.py").read_text()
    assert ".bench-venv/" in (ROOT / ".gitignore").read_text().splitlines()
