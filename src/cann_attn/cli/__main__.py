"""``python -m cann_attn.cli``: the ``cann-attn`` command."""

import sys

from .main import main

sys.exit(main())
