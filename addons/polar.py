"""polar-mitm as a mitmproxy script, from a checkout:

    mitmdump -s addons/polar.py --set polar_upstream=http://127.0.0.1:8000

From an install use `mitmdump -s "$(polar-mitm addon)"` (the same addons, shipped in the package)
or `polar-mitm proxy --upstream URL`. This file only puts the checkout's package first on the path.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.addons.polar import polar_addons  # noqa: E402

addons = [*polar_addons()]
