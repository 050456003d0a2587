"""`python -m relaytrain.cli`, as the `relaytrain` console script."""

import sys

from relaytrain.cli import main

sys.exit(main())
