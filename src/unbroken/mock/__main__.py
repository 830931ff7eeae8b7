"""``python -m unbroken.mock``."""

import sys

from unbroken.mock.cli import main_mock

raise SystemExit(main_mock(sys.argv[1:]))
