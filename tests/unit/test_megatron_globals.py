"""The shim (runtime/megatron_globals.py) names every parallel_state global of the pinned
Megatron-Core: a global it neither sets nor declares unused fails here, so a group or rank list
Megatron adds later cannot silently keep a stale or world-wide value on a pool."""

import subprocess
import sys

from earl_megatron.runtime import megatron_globals


def _import_time_none_globals() -> set:
    # a fresh interpreter: this process's parallel_state may hold groups set by another test
    code = ("import megatron.core.parallel_state as ps\n"
            "print(sorted(n for n, v in vars(ps).items() if n.startswith('_') "
            "and not n.startswith('__') and v is None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    return set(eval(out.strip().splitlines()[-1]))


def test_the_shim_names_every_parallel_state_global():
    found = _import_time_none_globals()
    declared = set(megatron_globals.SET) | set(megatron_globals.UNUSED)
    assert found - declared == set(), (
        f"parallel_state has globals the shim does not cover: {sorted(found - declared)}; "
        "set them in runtime/megatron_globals.py from the pool's groups, or list them in UNUSED "
        "with why they stay None")
    assert declared - found == set(), f"the shim names globals Megatron lost: {declared - found}"
    assert set(megatron_globals.SET) & set(megatron_globals.UNUSED) == set()


def test_the_shim_sets_the_groups_and_rank_lists_it_names():
    assert len(megatron_globals.SET) == 33
    assert all(n.endswith(("_GROUP", "_GROUP_GLOO", "_GROUP_WITH_CP", "_GROUP_WITH_CP_GLOO",
                           "_RANKS", "_RANKS_WITH_CP")) for n in megatron_globals.SET)
