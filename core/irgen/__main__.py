"""``python -m irgen``: the same as the ``irgen`` command."""

from irgen.cli import main

raise SystemExit(main())
