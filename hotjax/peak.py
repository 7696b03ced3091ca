"""`python -m hotjax.peak FILE ARGS...`: `hotjax ARGS...`, then the process's own peak resident
memory in bytes written to FILE as it exits.

The peak is the process's VmHWM (Linux), read at exit: unlike the `ru_maxrss` a parent reads
after `wait`, it does not count the pages the child shared with its parent between fork and
exec. The benchmarks and tests that bound a conversion's memory run it this way.
"""

import atexit
import sys


def _write_peak(path: str) -> None:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    with open(path, "w") as out:
        out.write(str(kib * 1024))


if __name__ == "__main__":
    atexit.register(_write_peak, sys.argv[1])
    from hotjax.cli import main

    sys.exit(main(sys.argv[2:]))
