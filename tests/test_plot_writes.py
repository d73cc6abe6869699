"""``replay --plot`` and ``simulate --sweep`` write their plot whole or not at all: an
interruption mid-write (SIGTERM, Ctrl-C) leaves neither half an image nor the temporary file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: runs the CLI with a ``savefig`` that writes half an image, then receives ``SIGNAL``
_CUT_SHORT = """
import os, signal, sys
from matplotlib.figure import Figure
from kvstrata.cli import main

SIGNAL = getattr(signal, sys.argv[1])

def cut_short(self, target, **kwargs):
    if isinstance(target, (str, os.PathLike)):  # a file name: savefig opens it, truncating it
        target = open(target, "wb")
    target.write(b"\\x89PNG half")
    target.flush()
    os.kill(os.getpid(), SIGNAL)
    for _ in range(100):  # the handler runs between two bytecodes: one of these
        pass
    raise AssertionError("the signal did not stop the write")

Figure.savefig = cut_short
sys.argv = ["kvstrata", *sys.argv[2:]]
main()
"""


def run_cut_short(sig: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    (cwd / "tmp").mkdir()
    env.update({"PYTHONPATH": str(REPO / "src"), "TMPDIR": str(cwd / "tmp"), "COLUMNS": "200"})
    env["KVSTRATA_CACHE_DIR"] = str(cwd / "cache")
    return subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, sig, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_replay_plot_interrupted_mid_write_leaves_no_half_file(tmp_path: Path, sig: str, code: int) -> None:
    """``replay --plot`` wrote straight into the PNG: a SIGTERM there (replay's handler exits at
    once) left half an image under the user's name; a second Ctrl-C did the same."""
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "hits.png").write_bytes(b"an earlier plot")
    done = run_cut_short(sig, "replay", "--limit", "30", "--plot", str(plots / "hits.png"), cwd=tmp_path)
    assert (plots / "hits.png").read_bytes() == b"an earlier plot", done.stderr
    assert sorted(p.name for p in plots.iterdir()) == ["hits.png"]  # no .hits.png.PID.partial
    assert done.returncode == code, done.stderr
    assert "while writing --plot" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary L3 directory went too


def test_sweep_plot_terminated_mid_write_leaves_no_partial_file(tmp_path: Path) -> None:
    """The sweep's plot was already written under a temporary name, but SIGTERM's default action
    skipped the ``finally`` that removes it: a hidden ``.s.png.PID.partial`` stayed."""
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    plots.mkdir()
    args = [
        "simulate",
        "--limit",
        "50",
        "--sweep",
        str(plots / "s.png"),
        "--capacities",
        "1",
        "--policies",
        "lru",
    ]
    done = run_cut_short("SIGTERM", *args, cwd=tmp_path)
    assert done.returncode == 143, done.stderr
    assert "terminated while writing --sweep" in done.stderr and "Traceback" not in done.stderr
    assert "lru" in done.stdout  # the numbers came first
    assert list(plots.iterdir()) == []


def test_the_handlers_are_restored_after_the_write(tmp_path: Path) -> None:
    from kvstrata.cli.interrupt import writing_output

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with writing_output("--plot", tmp_path / "x.png"):
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
