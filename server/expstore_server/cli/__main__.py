"""``python -m expstore_server.cli``: the ``expstore`` command."""

import sys

from . import main

sys.exit(main())
