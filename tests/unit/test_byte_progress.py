"""earl_megatron/progress.py: the conversion's bytes bar (plain lines off a terminal, a rich bar
on one) and the phase lines of the fixture build."""

import io
import re

from rich.console import Console

from earl_megatron.progress import ByteProgress, phase_printer


def test_plain_lines_a_tenth_apart_and_the_total_at_the_end():
    buf = io.StringIO()
    with ByteProgress("copy", 1000, console=Console(file=buf)) as bar:
        for done in range(0, 1001, 7):   # 143 updates
            bar.update(done)
        bar.update(1000)
        bar.phase("renaming")
    lines = buf.getvalue().splitlines()
    assert "\x1b[" not in buf.getvalue()
    assert lines[0] == "copy: 1000 B to go"
    pct = [int(m[1]) for m in (re.search(r"\((\d+)%\)", l) for l in lines[1:-2]) if m]
    assert len(pct) == len(lines) - 3 == 9                 # one line per tenth crossed
    assert [p // 10 for p in pct] == list(range(1, 10))
    assert re.fullmatch(r"copy: renaming \(elapsed \d\d:\d\d\)", lines[-2])
    assert re.fullmatch(r"copy: done: 1000 bytes in [\d.]+ s \(.+/s\)", lines[-1])


def test_a_bar_on_a_terminal_and_nothing_when_disabled():
    buf = io.StringIO()
    with ByteProgress("copy", 1 << 20, console=Console(file=buf, force_terminal=True,
                                                       width=120)) as bar:
        bar.update(1 << 19)
    out = buf.getvalue()
    assert "\x1b[" in out and "copy: done: 524288 bytes" in out
    assert "of 1.0 MiB (50%)" not in out                 # the bar, not the plain lines
    quiet = io.StringIO()
    with ByteProgress("copy", 10, console=Console(file=quiet), enabled=False) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""


def test_phase_lines_carry_the_elapsed_time():
    buf = io.StringIO()
    say = phase_printer("smollm2", buf)
    say("checking the GGUF's sha256")
    say("done")
    assert [re.sub(r"\d\d:\d\d", "mm:ss", l) for l in buf.getvalue().splitlines()] == [
        "[smollm2 mm:ss] checking the GGUF's sha256", "[smollm2 mm:ss] done"]
