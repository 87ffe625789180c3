"""``python -m mmreplay.cli ...``: the ``mmreplay`` console script."""

import sys

from mmreplay.cli.main import main

sys.exit(main())
