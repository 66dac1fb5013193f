"""earl view at scale: a run directory of 200 iterations and 5,000 samples (testing/viewer_runs.py,
rank 0's file per iteration), served by the real server, loaded in Debian's headless
Chromium (`make browser`). Prints, for each view, the time until the page has drawn it (from
navigation start, the browser's own clock) and the bytes the server sent, and the largest answer.
One run, values printed, nothing asserted:

    python benchmarks/viewer.py [--iterations 200] [--samples 5000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_megatron.testing.browser import chromium, wait_for  # noqa: E402
from earl_megatron.testing.viewer_runs import write_run  # noqa: E402
from earl_megatron.viewer import server as viewer  # noqa: E402

VIEWS = {"run": "document.querySelectorAll('#run-charts svg.plot').length >= 8",
         "layouts": "document.querySelectorAll('#timeline rect.cell').length > 0",
         "episodes": "document.querySelectorAll('#sample-list tr[data-key]').length > 0",
         "episode": "document.querySelectorAll('#sample-detail .turn').length > 0"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--samples", type=int, default=5000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        run = write_run(Path(tmp) / "run", args.iterations, args.samples // args.iterations,
                        replicas=1)
        print(f"run dir: {args.iterations} iterations, {args.samples} samples written in "
              f"{time.perf_counter() - t:.1f} s")
        sent: list[tuple[str, int]] = []
        answer = viewer.answer

        def counted(r, path, query):
            got = answer(r, path, query)
            sent.append((path, len(got[2])))
            return got

        viewer.answer = counted
        srv = viewer.make_server(run, port=0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}/"
        print(f"{'view':10} {'drawn after (ms)':>16} {'requests':>9} {'bytes sent':>11}")
        with chromium() as d:
            for view, ready in VIEWS.items():
                sent.clear()
                d.get("about:blank")
                target = "#episodes/100.-.5" if view == "episode" else f"#{view}"
                d.get(url + target)
                wait_for(d, ready, 300)
                ms = d.execute_script("return performance.now()")
                time.sleep(0.5)   # answers still in flight (the first poll) are counted too
                print(f"{view:10} {ms:16.0f} {len(sent):9d} {sum(n for _, n in sent):11,d}")
            t = time.perf_counter()
            d.find_element("css selector", "#filters [name=q]").send_keys("<calc>17*")
            wait_for(d, "document.getElementById('count').textContent.includes('of')", 300)
            biggest = max(sent, key=lambda x: x[1])
            print(f"search typed: list answered within {time.perf_counter() - t:.2f} s; "
                  f"largest answer {biggest[1]:,d} bytes ({biggest[0]})")
        srv.shutdown()


if __name__ == "__main__":
    main()
