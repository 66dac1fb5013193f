"""Every test module under tests/ has its own file name: the test folders are not packages, so
pytest imports each module by its base name, and two of one name in different folders stop a
whole-suite run (`make test`) at collection ("import file mismatch") although each folder passes
on its own."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).parents[1]


def test_no_two_test_modules_share_a_name():
    names = collections.defaultdict(list)
    for p in TESTS.rglob("test_*.py"):
        names[p.name].append(str(p.relative_to(TESTS)))
    assert len(names) > 50
    assert not {n: where for n, where in names.items() if len(where) > 1}
