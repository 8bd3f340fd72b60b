"""``python -m partialvfl.cli ...``: the ``partialvfl`` command."""

import sys

from partialvfl.cli import main

sys.exit(main())
