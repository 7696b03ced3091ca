"""`hotjax launch` passes each process's lines on, prefixed, without the runtime's chatter (gloo's
report that a rank met its peers) unless `--verbose` asks for it; a launch of one process says
that it makes no cluster."""

import io
import subprocess
import sys

import pytest

from hotjax import launch
from hotjax.launch import _Relay

GLOO = ("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks "
        "is : 1\n")


@pytest.mark.parametrize("verbose", [False, True])
def test_gloos_chatter_is_hidden_unless_verbose(verbose):
    lines = f"step 1\n{GLOO}step 2\n"
    process = subprocess.Popen([sys.executable, "-c", f"print({lines!r}, end='')"],
                               stdout=subprocess.PIPE, text=True)
    out = io.StringIO()
    relay = _Relay(process, "[1] ", out, verbose)
    relay.start()
    relay.join(30)
    process.wait()
    shown = ["step 1\n", GLOO, "step 2\n"] if verbose else ["step 1\n", "step 2\n"]
    assert out.getvalue() == "".join(f"[1] {line}" for line in shown)


def test_a_launch_of_one_process_says_it_makes_no_cluster():
    out = io.StringIO()
    assert launch.run([sys.executable, "-c", "print('trained')"], 1, 1, out=out, pin=False) == 0
    assert out.getvalue() == (
        "hotjax launch: 1 process: it joins no cluster and runs no collectives, as the command "
        "would without hotjax launch (pass --processes 2 or more for a cluster)\n[0] trained\n")
