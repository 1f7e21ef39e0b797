"""``python -m app.cli``: the ``rag`` command."""

import sys

from app.cli import main

sys.exit(main())
