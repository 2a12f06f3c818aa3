"""``python experiments/throughput ...``, or ``python -m throughput ...`` from ``experiments/``:
the benchmark's command line (:func:`throughput.cli.main`); also how the driver starts its
workers."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: import the package from experiments/, not its files
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from throughput.cli import main  # noqa: E402

sys.exit(main())
