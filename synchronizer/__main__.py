"""`python -m synchronizer` is the `diloco-synchronizer` command."""

import sys

from synchronizer.cli import main

sys.exit(main())
