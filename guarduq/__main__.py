"""``python -m guarduq`` runs the CLI."""

import sys

from guarduq.cli import main

sys.exit(main())
