"""``python -m mmreplay ...``: the ``mmreplay`` console script (``mmreplay.cli``)."""

import sys

from mmreplay.cli.main import main

sys.exit(main())
