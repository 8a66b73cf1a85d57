"""`python -m learner` is the `diloco-learner` command."""

import sys

from learner.cli import main

sys.exit(main())
