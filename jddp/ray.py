"""``python -m jddp.ray``: a jddp job on a Ray cluster, one process per worker
(:mod:`jddp.launch.ray_cluster`). Importing this module does not import Ray.

    python -m jddp.ray --num-workers 4 --gpus-per-worker 8 -- python -m jddp.train --config F
"""

import sys

from jddp.launch.ray_cluster import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
