"""``python -m jaxoverride``: the self-check; see ``jaxoverride.self_check``."""

import sys

from jaxoverride._selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
