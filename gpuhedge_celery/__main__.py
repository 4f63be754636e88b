"""``python -m gpuhedge_celery`` runs the CLI (same as the ``gpuhedge-celery`` script)."""

import sys

from .cli import main

sys.exit(main())
