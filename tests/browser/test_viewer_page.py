"""``earl view`` on a run a short training job made, in Debian's headless Chromium (`make
browser` installs it; `make test-browser` runs this; .ci/run calls it).

The run: the calculator (tool) environment on 2 ranks, a short supervised warm start so the
policy writes <calc> tool calls, 2 RL iterations with a KL loss (so a LOGPROB stage runs), rollout dp2 with run.samples_all_replicas, so
both replicas write their samples (iter_N.r0/.r1). The page must draw the run's plots with its
points, list every stage in the layout timeline, list every written sample, and show an
episode with a tool call: its trained and untrained spans and the tool's answer, each turn's
policy version. EARL_VIEWER_SHOTS=DIR also saves a screenshot of each view there (docs/images).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from earl_megatron.testing.browser import chromium, wait_for
from earl_megatron.trainer.samples import read_samples

pytestmark = pytest.mark.timeout(1500)   # the training run is the fixture of the first test

RUN = ["--config-name", "tool_use", "run.iterations=2", "run.live_view=false",
       "run.checkpoint_every=0", "run.eval_episodes=4", "rollout.episodes_per_iteration=16",
       "algorithm.micro_batch_size=4", "sft.steps=60", "sft.batch_size=16",
       "sft.expert_episodes=128", "sft.log_every=20", "run.samples_per_iteration=8",
       "run.samples_all_replicas=true", "layout=static", "layout.rollout=dp2",
       "layout.logprob=dp2", "layout.train=dp2", "algorithm.kl_mode=loss", "algorithm.kl_coef=0.01"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("viewer") / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "train",
                           "--nproc-per-node", "2", *RUN, f"run.output_dir={out}"],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def page(run_dir):
    proc = subprocess.Popen([sys.executable, "-m", "earl_megatron.cli", "view", str(run_dir),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://\S+/) ", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        with chromium() as driver:
            yield driver, m.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _shot(driver, name):
    where = os.environ.get("EARL_VIEWER_SHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(where) / f"viewer_{name}.png"))


def test_the_run_view_draws_every_iteration(page, run_dir):
    driver, url = page
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    driver.get(url + "#run")
    # the reward chart: mean reward and illegal+unparsable, a point per iteration each
    points = wait_for(driver, """[...document.querySelectorAll('#run-charts .chart')]
        .filter(c => c.querySelector('h3').textContent === 'reward')
        .map(c => c.querySelector('svg.plot')).filter(s => s)
        .map(s => [Number(s.dataset.points), s.querySelectorAll('polyline').length])[0]""")
    assert points == [4, 2]
    titles = driver.execute_script("return [...document.querySelectorAll('#run-charts .chart')]"
                                   ".filter(c => c.querySelector('svg.plot'))"
                                   ".map(c => c.querySelector('h3').textContent)")
    for drawn in ("loss", "KL to the reference", "clip fraction and ratio",
                  "seconds per stage (stacked)",
                  "accuracy and tool use (evaluations as markers)"):
        assert drawn in titles
    bars = driver.execute_script("return [...document.querySelectorAll('#run-charts .chart')]"
                                 ".find(c => c.querySelector('h3').textContent.startsWith("
                                 "'seconds')).querySelectorAll('rect').length")
    assert bars >= 2 * 3   # two iterations, at least rollout, logprob/old_logprob and train
    _shot(driver, "run")


def test_the_layout_timeline_lists_every_stage(page, run_dir):
    driver, url = page
    driver.get(url + "#layouts")
    labels = wait_for(driver, "[...document.querySelectorAll('#timeline .stage-label')]"
                              ".map(t => t.textContent)")
    assert labels == ["rollout", "logprob", "train"]
    cells = driver.execute_script("return [...document.querySelectorAll('#timeline rect.cell')]"
                                  ".map(r => r.querySelector('title').textContent.split('\\n')[0])")
    assert sorted(cells) == sorted(f"{s}, iteration {i}: DP2" for s in labels for i in (0, 1))
    _shot(driver, "layouts")


def test_an_episode_shows_trained_spans_tool_calls_and_answers(page, run_dir):
    driver, url = page
    rows = [(rep, r) for it in (0, 1) for rep in (0, 1) for r in read_samples(run_dir, it, rep)]
    assert len(rows) == 2 * 2 * 8   # every episode of both replicas: the whole batch
    driver.get(url + "#episodes")
    listed = wait_for(driver, "document.querySelectorAll('#sample-list tr[data-key]').length")
    assert listed == min(len(rows), 50)
    calls = [(rep, r) for rep, r in rows if r["info"].get("tool_calls")]
    assert calls, "the warm-started policy made no tool call in 2 iterations"
    rep, r = calls[-1]
    key = f"{r['iteration']}.{rep}.{r['sample']}"
    driver.get(url + f"#episodes/{key}")
    call = r["actions"][0]
    got = wait_for(driver, "[...document.querySelectorAll('#sample-detail .seg.tool-call')]"
                           ".map(s => s.textContent)")
    assert call.strip() in [g.strip() for g in got]
    trained = driver.execute_script("return [...document.querySelectorAll('#sample-detail .turn "
                                    ".seg.trained')].map(s => s.textContent).join('')")
    assert trained == "".join(s["text"] for s in r["segments"] if s["trained"])
    untrained = driver.execute_script("return [...document.querySelectorAll('#sample-detail .turn "
                                      ".seg.untrained')].map(s => s.textContent).join('')")
    assert untrained == "".join(s["text"] for s in r["segments"] if not s["trained"])
    answers = driver.execute_script("return [...document.querySelectorAll("
                                    "'#sample-detail .turn.kind-tool')].map(t => t.textContent)")
    assert any("<result>" in a or "<error>" in a for a in answers)
    badge = driver.execute_script("return document.querySelector('#sample-detail .turn."
                                  "kind-assistant .badge').textContent")
    assert badge == f"policy v{r['turn_versions'][0]}"
    _shot(driver, "episode")
    # the search box filters the list by text: the tool call's text finds exactly the
    # episodes holding it (case-insensitive, over the text and the actions)
    holding = [f"{r['iteration']}.{rp}.{r['sample']}" for rp, r in rows
               if call.lower() in (r["text"] + "\n".join(r["actions"])).lower()]
    driver.find_element("css selector", "#filters [name=q]").send_keys(call.upper())
    shown = wait_for(driver, f"(() => {{ const k = [...document.querySelectorAll("
                             f"'#sample-list tr[data-key]')].map(tr => tr.dataset.key); "
                             f"return k.length === {len(holding)} ? k : null; }})()")
    assert sorted(shown) == sorted(holding) and key in shown
