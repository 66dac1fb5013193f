"""The ``slurm`` fixture: a Slurm client, or a skip naming the command that starts one."""

import pytest

from slurm_helpers import Slurm, slurm_up


@pytest.fixture(scope="session")
def slurm():
    if not slurm_up():
        pytest.skip("no Slurm here: run `make test-slurm` (tools/slurm_local.sh up starts one)")
    return Slurm()
