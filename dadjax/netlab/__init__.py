"""The network lab: each site its own process behind a real, shaped link, on one host.

``Lab`` builds network namespaces (one per site, plus a switch) joined by
veth links shaped with HTB in both directions, with an added delay through
netem-free relay of the lab's own; ``run_in_lab`` trains a dadjax config
with one JAX process per site (``dadjax.initialize``, gloo CPU collectives,
the coordinator in site 0) and measures every step's wall time, split into
compute and communication. Needs Linux, root and iproute2 (``ip``, ``tc``).
Everything the lab creates is named ``dxl<pid>...`` and deleted on exit,
also on Ctrl-C or a crash. From the shell::

  dadjax netlab --sites 4 --rate 100mbit --delay 10ms train method=powersgd:2 steps=50
"""

from dadjax.netlab._lab import (
    Lab,
    LabUnavailable,
    check_available,
    parse_rate,
    parse_time,
    sweep,
)
from dadjax.netlab._bench import measure_collectives
from dadjax.netlab._cli import add_parser
from dadjax.netlab._model import collective_operands, predicted_comm
from dadjax.netlab._run import LabRun, run_in_lab

__all__ = ["Lab", "LabRun", "LabUnavailable", "run_in_lab", "check_available", "sweep",
           "parse_rate", "parse_time", "measure_collectives", "collective_operands",
           "predicted_comm", "add_parser"]
