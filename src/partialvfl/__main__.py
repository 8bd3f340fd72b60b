"""``python -m partialvfl ...``: the ``partialvfl`` command (how a party process is started without the script)."""

import sys

from partialvfl.cli import main

if __name__ == "__main__":  # not when a documentation tool imports the module
    sys.exit(main())
