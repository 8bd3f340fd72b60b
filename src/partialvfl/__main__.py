"""``python -m partialvfl ...``: the ``partialvfl`` command (how a party process is started without the script)."""

import sys

from partialvfl.cli import main

sys.exit(main())
