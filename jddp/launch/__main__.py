"""``python -m jddp.launch``: the launcher's command line (:func:`jddp.launch.main`)."""

import sys

from jddp.launch import main

sys.exit(main())
