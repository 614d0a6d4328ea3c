"""`python -m bench.lab NAME [args]`: bench/lab/runner.py runs experiment NAME."""

import sys

from bench.lab.runner import main

sys.exit(main())
