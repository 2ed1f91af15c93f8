"""``python -m nbaccel <command>``: the same as the ``nbaccel`` console script."""

import sys

from nbaccel.cli import main

sys.exit(main())
