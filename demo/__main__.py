"""`python -m demo` is the `diloco-learner` command."""

import sys

from demo.cli import main

sys.exit(main())
