"""``python -m partialvfl.bench bench|report ...``: the bench commands without the main CLI."""

import sys

from partialvfl.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
