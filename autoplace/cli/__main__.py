"""``python -m autoplace.cli``: the same as the ``autoplace`` command."""

from __future__ import annotations

import sys

from autoplace.cli import main

sys.exit(main())
