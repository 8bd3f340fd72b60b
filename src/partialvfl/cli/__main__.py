"""``python -m partialvfl.cli ...``: the ``partialvfl`` command."""

import sys

from partialvfl.cli import main

if __name__ == "__main__":  # not when a documentation tool imports the module
    sys.exit(main())
