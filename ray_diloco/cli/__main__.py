"""``python -m ray_diloco.cli``: the ``ray-diloco`` command."""

import sys

from ray_diloco.cli import main

sys.exit(main())
