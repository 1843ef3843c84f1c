"""`python -m services.cli`: the `pdserve` command."""

import sys

from services.cli import main

sys.exit(main())
