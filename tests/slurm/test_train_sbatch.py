"""recipes/slurm/train.sbatch on a real Slurm (two emulated nodes on this host): a 2-node job
runs to completion and checkpoints; a 1-node job resumes its checkpoint (on another world size)
and continues with every iteration exactly once; launcher misconfiguration is one line in the
job log and exit 2."""

from slurm_helpers import SMALL, metrics, strip


def test_two_node_job_then_one_node_resume(slurm, tmp_path):
    out = tmp_path / "run"
    common = SMALL + ["layout=auto", "rollout.episodes_per_iteration=4",
                      f"run.output_dir={out}"]
    job = slurm.submit(2, common + ["run.iterations=2"], tmp_path, EARL_NPROC_PER_NODE="1")
    info = slurm.wait(job, 400)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]"
    assert "2 nodes x 1 ranks" in log
    first = metrics(out)
    assert [h["iteration"] for h in first] == [0, 1]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000001"

    # the same run continued on ONE node, one rank: an elastic resume (2 ranks -> 1) at
    # iteration 2, layouts planned anew for the new world
    job = slurm.submit(1, common + ["run.iterations=4"], tmp_path, EARL_NPROC_PER_NODE="1")
    info = slurm.wait(job, 400)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert "1 nodes x 1 ranks" in log and "resumed from" in log
    assert "checkpoint of 2 ranks resumed on 1" in log
    hist = metrics(out)
    assert [h["iteration"] for h in hist] == [0, 1, 2, 3]
    assert all(lay == "TP1" for h in hist[2:] for lay in h["layouts"].values())
    assert strip(hist[:2]) == strip(first)  # the 2-node iterations kept as they were
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000003"


def test_launcher_errors_are_one_line_exit_2(slurm, tmp_path):
    # a CPU partition without EARL_NPROC_PER_NODE: no GPUs to count ranks from
    job = slurm.submit(1, SMALL, tmp_path)
    info = slurm.wait(job, 120)
    log = slurm.log(job).strip().splitlines()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", log
    assert len(log) == 1 and "no GPUs in the allocation" in log[0] \
        and "EARL_NPROC_PER_NODE" in log[0], log
    # a repo that is not one
    job = slurm.submit(1, SMALL, tmp_path, EARL_NPROC_PER_NODE="1", EARL_REPO=str(tmp_path))
    info = slurm.wait(job, 120)
    log = slurm.log(job).strip().splitlines()
    assert info["ExitCode"] == "2:0" and len(log) == 1 and "EARL_REPO" in log[0], log
