"""Training throughput benchmark: jddp vs PyTorch DDP. The code is the ``experiments/throughput/``
package; this file keeps ``python experiments/bench.py ...`` working. Method and options:
``experiments/README.md`` (or ``--help``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: the package, benchlib
from throughput.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
