"""``python -m unbroken.mock``."""

import sys

from unbroken.mock.command import main_mock

raise SystemExit(main_mock(sys.argv[1:]))
